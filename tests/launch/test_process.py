"""Process-wide set-up a launcher does: the freed heap kept as `train.keep_heap` says."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.config import RelayConfig
from relayrl.launch import run
from relayrl.train.config import TrainConfig


class _Stop(Exception):
    """Raised where the trainer would start: the test is about what comes before it."""


def _no_trainer(*args: object, **kwargs: object) -> None:
    raise _Stop


@pytest.mark.parametrize("keep", [True, False])
def test_train_keeps_the_freed_heap_as_configured(keep: bool, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(run, "keep_freed_heap", lambda: calls.append(True) or True)
    monkeypatch.setattr(run, "PPOTrainer", _no_trainer)
    cfg = RelayConfig(fileroot=str(tmp_path), train=TrainConfig(keep_heap=keep))
    with pytest.raises(_Stop):
        run.train(cfg, [{"question": "1 + 1", "answer": "2"}], workflow="agent.Agent")
    assert calls == ([True] if keep else [])
