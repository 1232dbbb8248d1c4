"""The process's C heap: what `keep_freed_heap` changes in how glibc serves a training thread."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relayrl import heap

# In a fresh process: a worker thread (as the trainer's update thread) allocates and frees a
# 256 MiB tensor, then allocates a 192 MiB one (an update's shapes vary, and small blocks may
# take the freed block's start); printed: the minor page faults of the second one.
_PROBE = """
import json, resource, sys, threading
import torch
from relayrl.heap import keep_freed_heap
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


def test_a_process_keeping_its_heap_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_kept", False)  # whatever an earlier test's run set
    assert not heap.kept()
    assert heap.keep_freed_heap() is heap.kept()
    if sys.platform.startswith("linux"):
        assert heap.kept()
