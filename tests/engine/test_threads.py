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


def test_set_threads_takes_effect_at_the_next_pass_and_none_restores(model_dir: str) -> None:
    from relayrl.engine.local import LocalEngine
    from relayrl.types import GenerateRequest, SamplingParams

    engine = LocalEngine(model_dir, device="cpu", dtype="float32", max_context=64, num_threads=1)
    try:
        def run() -> None:
            import asyncio

            asyncio.run(engine.generate(GenerateRequest(
                prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=2, temperature=0.0))))

        run()
        assert engine.threads_in_use == 1
        engine.set_threads(2)
        run()
        assert engine.threads_in_use == 2
        engine.set_threads(None)
        run()
        assert engine.threads_in_use == 1
        with pytest.raises(ValueError, match=">= 1"):
            engine.set_threads(0)
    finally:
        engine.close()
