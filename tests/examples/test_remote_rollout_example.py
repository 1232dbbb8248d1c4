"""The remote rollout example: a rollout server child process, a gateway, one grouped batch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "remote_rollout" / "run_episodes.py"


def test_example_runs_a_batch_through_a_server_process() -> None:
    spec = importlib.util.spec_from_file_location("remote_rollout_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    summary = module.main(["--engine", "fake", "--groups", "2", "--group-size", "2"])
    assert summary["episodes"] == 4 and summary["workflow_completed"] == 4
    # one LLM call per episode ("ok" calls no tool), each mask checked, none disagreeing
    assert summary["workflow_mask_checks"] == 4 and summary["workflow_mask_mismatches"] == 0
