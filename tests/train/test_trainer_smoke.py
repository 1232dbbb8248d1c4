"""A short real `relayrl train` run: gateway, LocalEngine, agent, SFT warm-start, GRPO steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.config import RelayConfig, load_config
from relayrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "math_agent" / "config.yaml"


def test_the_example_config_loads_and_bad_overrides_name_their_key() -> None:
    cfg = load_config(RelayConfig, CONFIG, ["rollout.group_size=2", "train.lr=1e-5"])
    assert cfg.rollout.group_size == 2 and cfg.train.lr == 1e-5
    with pytest.raises(ConfigError, match=r"train\.lrr"):
        load_config(RelayConfig, CONFIG, ["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"rollout\.group_size"):
        load_config(RelayConfig, CONFIG, ["rollout.group_size=eight"])
    with pytest.raises(ConfigError, match="loss_agg"):
        load_config(RelayConfig, CONFIG, ["train.loss_agg=sum"])
    # works with data-parallel ranks (tests/train/test_distributed.py)
    assert load_config(RelayConfig, CONFIG, [
        "train.kl_coef=0.05", "train.sft_replay_coef=0.5", "train.world_size=2",
    ]).train.world_size == 2
    with pytest.raises(ConfigError, match="minibatches must be > 0"):
        load_config(RelayConfig, CONFIG, ["train.minibatches=0"])
    with pytest.raises(ConfigError, match="sft_replay_coef must be >= 0"):
        load_config(RelayConfig, CONFIG, ["train.sft_replay_coef=-1"])


@pytest.mark.slow
def test_relayrl_train_runs_steps_and_writes_checkpoint_metrics_and_plot(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples" / "math_agent"))
    from teacher import generate_traces

    from relayrl.models import model_path
    from relayrl.train.trainer import load_dataset

    items = load_dataset(ROOT / "examples" / "math_agent" / "train.jsonl")
    traces = tmp_path / "traces.jsonl"
    generate_traces(model_path("smollm2-135m-instruct"), items[:8], 8, out_path=traces)
    overrides = [
        f"fileroot={tmp_path / 'runs'}", "trial_name=smoke", f"sft.data={traces}",
        "sft.max_rows=8", "eval.max_items=2", "eval.base=false", "train.total_steps=2",
        "rollout.group_size=2", "rollout.batch_size=2", "workflow_kwargs.max_tokens=24",
        "train.drop_uniform_groups=false",  # every batch then takes a step: 2 steps exactly
        "eval.every=1",
        "train.kl_coef=0.05",
        # fp32: in bf16 the replayed traces joining the RL rows' micro-batches change the
        # products' shapes, so the update's logprobs differ from the reference's (the same
        # weights) by bf16 rounding (KL ~3e-4 at step 1)
        "train.bf16=false",
        "train.sft_replay_coef=0.5", "train.sft_replay_rows=3",  # PPO-ptx on the traces
        f"data.train={ROOT / 'examples' / 'math_agent' / 'train.jsonl'}",
        f"data.eval={ROOT / 'examples' / 'math_agent' / 'eval.jsonl'}",
    ]
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", str(CONFIG), *overrides],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out reward" in proc.stdout and "before RL" in proc.stdout
    run = tmp_path / "runs" / "math_agent" / "smoke"
    ckpt = run / "checkpoints" / "step_2"
    assert (ckpt / "config.json").exists() and (ckpt / "relayrl_state.json").exists()
    lines = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "step_s" in m] == [1, 2]
    # the KL's reference is the model as loaded: the warm-start already moved step 1 from it
    kl = {m["step"]: m["ref_kl"] for m in lines if "ref_kl" in m}
    assert kl[1] > 0 and kl[2] > 0
    replay = [m["sft_replay_loss"] for m in lines if "sft_replay_loss" in m]
    assert len(replay) == 2 and all(0 < x < 20 for x in replay)
    assert any("eval_reward_after" in m for m in lines)
    # eval.every=1: step 1 is evaluated in the loop; step 2's weights only once, after RL
    assert [m["step"] for m in lines if "eval_reward" in m] == [1, 2]
    assert "eval at step 1:" in proc.stdout and "eval at step 2:" not in proc.stdout
    final = next(m for m in lines if "eval_reward_after" in m)
    assert final["eval_reward"] == final["eval_reward_after"]
    assert (run / "logs" / "reward_loss.png").stat().st_size > 1000
    assert list((run / "logs").glob("events.out.tfevents.*"))
