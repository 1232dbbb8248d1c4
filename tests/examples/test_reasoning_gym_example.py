"""The reasoning-gym main job: its config and items load, and a 2-step run trains end to end.

The run is the real thing, shrunk: the real reasoning-gym package generates and scores the
questions, the default model answers them through the trainer's own gateway, and GRPO updates it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import RelayConfig, load_config
from relayrl.envs.reasoning_gym import LAST_NUMBER
from relayrl.train.trainer import load_dataset

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "examples" / "reasoning_gym"


def test_the_config_and_items_load_and_name_reasoning_gym_entries() -> None:
    cfg = load_config(RelayConfig, HERE / "config.yaml")
    assert cfg.workflow == "relayrl.envs.reasoning_gym:ReasoningGymAgent"
    train, held_out = load_dataset(cfg.data.train), load_dataset(cfg.data.eval)
    assert len(train) == 256 and len(held_out) == 64
    specs = {(i["reasoning_gym"]["dataset"], i["reasoning_gym"]["seed"]) for i in train + held_out}
    assert specs == {("basic_arithmetic", 1), ("basic_arithmetic", 2)}  # another seed held out


def test_the_items_are_what_reasoning_gym_generates_today() -> None:
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed")
    from relayrl.envs.reasoning_gym import make_items

    held_out = load_dataset(HERE / "eval.jsonl")
    spec = held_out[0]["reasoning_gym"]
    assert make_items(spec["dataset"], size=spec["size"], seed=spec["seed"],
                      config=spec["config"]) == held_out


@pytest.mark.slow
def test_two_grpo_steps_on_reasoning_gym_scored_by_its_own_scorer(tmp_path: Path) -> None:
    """The README's second main job cut down to 2 steps (CI's smoke run of it)."""
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed")
    overrides = [
        f"fileroot={tmp_path}", "trial_name=smoke", "train.total_steps=2",
        "rollout.group_size=2", "rollout.batch_size=2", "rollout.dynamic_sampling=false",
        "train.drop_uniform_groups=false",  # every batch then takes a step: 2 steps exactly
        "eval.max_items=4",
    ]
    proc = subprocess.run([sys.executable, str(HERE / "train.py"), *overrides],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = re.search(r"held-out reward before RL (\d\.\d+) -> after RL (\d\.\d+)",
                        proc.stdout)
    assert summary, proc.stdout[-3000:]
    assert re.search(r"format compliance .*: before RL \d\.\d+ -> after RL \d\.\d+",
                     proc.stdout), proc.stdout[-3000:]
    run = tmp_path / "reasoning_gym" / "smoke"
    lines = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "step_s" in m]
    assert [m["step"] for m in steps] == [1, 2]
    # the agent's counters reach the step metrics: 2 questions x 2 episodes a step; they are
    # read while the next batch's episodes run, so step 2 holds at least step 1's batch
    assert steps[-1]["workflow/episodes"] >= 4 and 0 <= steps[-1]["workflow/mean_score"] <= 1
    final = next(m for m in lines if "eval_reward_after" in m)
    assert (final["eval_reward_before"], final["eval_reward_after"]) == (
        pytest.approx(float(summary[1]), abs=1e-3), pytest.approx(float(summary[2]), abs=1e-3))
    # the held-out replies the format rate reads: 4 items before RL (version 0), 4 after (2)
    for version in (0, 2):
        dumped = [x for f in (run / "eval-rollout" / str(version)).glob("*.jsonl")
                  for x in f.read_text().splitlines()]
        assert len(dumped) == 4
    assert (run / "checkpoints" / "step_2" / "config.json").exists()
    assert (run / "logs" / "reward_loss.png").stat().st_size > 1000


def test_the_format_rate_counts_answers_found_in_the_dumped_held_out_replies(
        tmp_path: Path) -> None:
    # by path under its own name: other examples have a train.py too
    spec = importlib.util.spec_from_file_location("reasoning_gym_train", HERE / "train.py")
    assert spec is not None and spec.loader is not None
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    format_rates = job.format_rates
    assert format_rates(tmp_path) == {}  # no eval dumped: nothing to report
    # before: an equation, a wrong one, a sentence cut off at max_tokens (no end token)
    replies = {0: [("1 + 5 = 6<|im_end|>", 1.0), ("1 + 5 = 7<|im_end|>", 0.0),
                   ("To add 1 and 5, we", 0.0)],
               3: [("6<|im_end|>", 1.0), (" 14<|im_end|>", 0.0), ("-2.5<|im_end|>", 0.0)]}
    for version, texts in replies.items():
        folder = tmp_path / "eval-rollout" / str(version)
        folder.mkdir(parents=True)
        (folder / "t.jsonl").write_text("".join(
            json.dumps({"completion": t, "reward": r}) + "\n" for t, r in texts))
    # the example's rule: the last number in the reply is the answer; a cut reply does not count
    rates = format_rates(tmp_path, answer_tag=None, answer_pattern=LAST_NUMBER)
    assert rates == {"before": pytest.approx(2 / 3), "after": 1.0,
                     "full_before": pytest.approx(1 / 3), "full_after": pytest.approx(1 / 3)}
