"""The main job's seed sweep: each seed's results read back from the metrics the trainer writes,
and the lift's mean and spread over the runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.train.metrics import MetricsLogger
from tests.examples import load_example

seeds = load_example("math_agent", "seeds")


def _write_run(logs: Path, before: float, after: float, skipped: int) -> Path:
    """metrics.jsonl as the trainer writes it: step records, then the final evals."""
    logger = MetricsLogger(logs, tensorboard=False)
    for step in (1, 2):
        logger.log(step, {"loss": 0.1, "reward_mean": 0.5, "skipped_batches": float(skipped),
                          "set_aside_groups": 3.0 * step})
    logger.log(2, {"eval_before_step": 0, "eval_reward_base": 0.1, "eval_reward_before": before,
                   "eval_reward_after": after, "eval_tool_call_rate_before": 0.4,
                   "eval_tool_call_rate_after": 0.9, "eval_reward_before_sampled": before / 2,
                   "eval_reward_after_sampled": after / 2 + 0.1})
    logger.close()
    return logs / "metrics.jsonl"


def test_seed_lists_are_split_from_the_other_overrides() -> None:
    assert seeds.split_seeds(["train.lr=1e-5", "seed=1,2,3"]) == ([1, 2, 3], ["train.lr=1e-5"])
    with pytest.raises(SystemExit, match="seed=1,2,3"):
        seeds.split_seeds(["train.lr=1e-5"])


def test_runs_are_read_back_and_the_lift_is_averaged_over_every_run(tmp_path: Path) -> None:
    runs = [seeds.read_run(s, 0, 600.0, _write_run(tmp_path / str(s), before, after, skipped))
            for s, before, after, skipped in [(1, 0.3, 0.6, 0), (2, 0.4, 0.4, 2), (3, 0.2, 0.5, 1)]]
    assert [round(r.lift, 6) for r in runs] == [0.3, 0.0, 0.3]
    assert runs[1].batches_without_signal == 2 and runs[0].set_aside_groups == 6
    assert runs[0].steps == 2 and runs[0].tool_rate_after == 0.9 and runs[0].wall_min == 10.0
    crashed = seeds.read_run(4, 1, 60.0, tmp_path / "none" / "metrics.jsonl")
    assert crashed.lift is None and crashed.returncode == 1
    report = seeds.table([*runs, crashed])
    assert "RL lift over 3 of 4 runs: mean +0.200, sample std 0.173" in report
    assert report.count("\n| ") == 5  # header separator, 3 runs and the crashed one
    assert "| 0 | 6 | 10.0 | 0 |" in report  # batches w/o signal, groups set aside, wall, exit
    assert runs[0].sampled_lift == pytest.approx(0.25) and crashed.sampled_lift is None
    assert "| 0.150 → 0.400 (+0.250) |" in report
    assert "Sampled lift (training settings) over 3 runs: mean +0.200" in report
