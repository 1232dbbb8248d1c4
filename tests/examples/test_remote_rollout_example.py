"""The remote rollout example: a rollout server child process, a gateway, one grouped batch."""

from __future__ import annotations

from tests.examples import load_example


def test_example_runs_a_batch_through_a_server_process() -> None:
    module = load_example("remote_rollout", "run_episodes")
    summary = module.main(["--engine", "fake", "--groups", "2", "--group-size", "2"])
    assert summary["episodes"] == 4 and summary["workflow_completed"] == 4
    # one LLM call per episode ("ok" calls no tool), each mask checked, none disagreeing
    assert summary["workflow_mask_checks"] == 4 and summary["workflow_mask_mismatches"] == 0
