"""The engine's default thread count leaves a core to the rest of the machine."""

from __future__ import annotations

import pytest
import torch

from relayrl.engine import local


@pytest.mark.parametrize(
    ("cores", "torch_threads", "expected"),
    [(2, 2, 1), (1, 1, 1), (16, 16, 15), (16, 4, 4), (8, 1, 1)],
)
def test_default_num_threads_leaves_one_core_and_respects_torch(
    monkeypatch: pytest.MonkeyPatch, cores: int, torch_threads: int, expected: int
) -> None:
    monkeypatch.setattr(local.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: torch_threads)
    assert local.default_num_threads() == expected
