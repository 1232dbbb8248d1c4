"""Process-wide set-up: what `keep_freed_heap` changes in how glibc serves a training thread."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import RelayConfig
from relayrl.launch import run
from relayrl.train.config import TrainConfig

# In a fresh process: a worker thread (as the trainer's update thread) allocates and frees a
# 256 MiB tensor, then allocates a 192 MiB one (an update's shapes vary, and small blocks may
# take the freed block's start); printed: the minor page faults of the second one.
_PROBE = """
import json, resource, sys, threading
import torch
from relayrl.launch.process import keep_freed_heap
kept = keep_freed_heap() if sys.argv[1] == "keep" else None
out = {}
def step():
    torch.ones(64 << 20).sum()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    torch.ones(48 << 20).sum()
    out["faults"] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
t = threading.Thread(target=step)
t.start()
t.join(60)
print(json.dumps({"kept": kept, **out}))
"""


def _second_allocation(arm: str) -> dict[str, int]:
    run = subprocess.run([sys.executable, "-c", _PROBE, arm], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_freed_tensor_memory_is_reused_without_faulting_it_in_again() -> None:
    default, kept = _second_allocation("default"), _second_allocation("keep")
    assert kept["kept"] is True
    pages = (192 << 20) // 4096
    # glibc as it comes maps the tensor afresh, so every page faults in again
    assert default["faults"] > pages // 4
    assert kept["faults"] < pages // 20



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
