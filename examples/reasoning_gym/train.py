"""The second main job: teach SmolLM2-135M a reasoning-gym task with its own scorer, on CPU.

No warm-start and no reward of ours: `ReasoningGymAgent` (relayrl.envs.reasoning_gym) asks each
question through the trainer's gateway and returns the dataset's own `score_answer`.
`relayrl.launch.train` evaluates the model as loaded on the held-out items, runs GRPO steps,
evaluates again, and writes metrics, a checkpoint and a plot under runs/reasoning_gym/<trial>/.

    python examples/reasoning_gym/train.py [dotted.overrides ...]
    python examples/reasoning_gym/train.py seed=1,2,3 [...]   # one run per seed, then the mean
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

from relayrl.config import RelayConfig, load_config  # noqa: E402
from relayrl.envs.reasoning_gym import extract_answer  # noqa: E402
from relayrl.launch import keep_freed_heap, train  # noqa: E402
from relayrl.train.trainer import load_dataset  # noqa: E402


def main(argv: list[str]) -> None:
    """Train once with the config and the overrides."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    started = time.perf_counter()
    cfg = load_config(RelayConfig, HERE / "config.yaml", argv)
    if cfg.rollout.dump_root is None:  # the held-out replies, for the format-compliance rate
        cfg = replace(cfg, rollout=replace(cfg.rollout, dump_root=cfg.fileroot))
    if cfg.train.keep_heap:  # before the gateway starts the first threads
        keep_freed_heap()
    result = train(cfg, load_dataset(cfg.data.train), load_dataset(cfg.data.eval),
                   workflow=cfg.workflow, workflow_kwargs=cfg.workflow_kwargs,
                   eval_workflow_kwargs=cfg.eval.workflow_kwargs or None)
    print(result.summary())
    rates = format_rates(cfg.run_dir, **answer_rule(cfg))
    if rates:
        print("held-out format compliance (the reply ended within max_tokens and holds an "
              "answer): before RL "
              f"{rates.get('before', float('nan')):.3f} -> after RL "
              f"{rates.get('after', float('nan')):.3f}; exactly right (score 1.0) "
              f"{rates.get('full_before', float('nan')):.3f} -> "
              f"{rates.get('full_after', float('nan')):.3f}")
    print(f"total wall time {(time.perf_counter() - started) / 60:.1f} min")


SPECIAL = re.compile(r"<\|[^|]*\|>")
ENDED = re.compile(r"<\|[^|]*\|>\s*$")
"""A dumped completion that ends with the end-of-turn token: the reply was not cut off."""


def answer_rule(cfg: RelayConfig) -> dict[str, Any]:
    """How the held-out episodes find the answer in a reply: the agent's answer_tag/pattern."""
    kwargs = {**(cfg.workflow_kwargs or {}), **(cfg.eval.workflow_kwargs or {})}
    return {"answer_tag": kwargs.get("answer_tag", "answer"),
            "answer_pattern": kwargs.get("answer_pattern")}


def format_rates(run_dir: Path, answer_tag: str | None = "answer",
                 answer_pattern: str | None = None) -> dict[str, float]:
    """Shares of the held-out greedy replies, first and last eval dumped, that ended within
    max_tokens with an answer the agent's rule finds (`before`, `after`: format compliance) and
    that scored full marks (`full_before`, `full_after`)."""
    root = run_dir / "eval-rollout"
    versions = sorted(int(d.name) for d in root.glob("*") if d.name.isdigit())
    out: dict[str, float] = {}
    for key, version in (("before", versions[:1]), ("after", versions[-1:])):
        records = [json.loads(x) for v in version for f in (root / str(v)).glob("*.jsonl")
                   for x in f.read_text().splitlines() if x.strip()]
        raw = [str(r.get("completion", "")) for r in records]
        if raw:
            out[key] = sum(bool(ENDED.search(t)) and extract_answer(
                SPECIAL.sub("", t).strip(), answer_tag, answer_pattern) is not None
                for t in raw) / len(raw)
            out[f"full_{key}"] = sum(float(r.get("reward") or 0) >= 1 for r in records) / len(raw)
    return out


def read_run(metrics: Path, rule: dict[str, Any]) -> dict[str, float]:
    """A finished run's held-out rewards from its metrics.jsonl (the last record holds them)."""
    if not metrics.is_file():
        return {}
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    final = next((r for r in reversed(records) if "eval_reward_after" in r), {})
    out = {k.removeprefix("eval_reward_"): float(final[k])
           for k in ("eval_reward_before", "eval_reward_after") if k in final}
    out["steps"] = sum("loss" in r for r in records)
    out.update({f"format_{k}": v for k, v in format_rates(metrics.parent.parent, **rule).items()})
    return out


def seeds(argv: list[str]) -> bool:
    """`seed=1,2,3`: one run per seed in its own process, then each run's lift and the mean."""
    seed_list = [int(s) for a in argv if a.startswith("seed=")
                 for s in a.removeprefix("seed=").split(",") if s.strip()]
    rest = [a for a in argv if not a.startswith("seed=")]
    cfg = load_config(RelayConfig, HERE / "config.yaml", rest)
    lines = ["| seed | before RL | after RL | lift | exactly right before -> after "
             "| answer found before -> after | steps | wall min "
             "| load avg (1/5/15 min) at start; at end | exit |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lifts: list[float] = []
    ok = True
    for seed in seed_list:
        trial = f"{cfg.trial_name}-seed{seed}"
        print(f"== seed {seed}: trial {trial}", flush=True)
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, *rest, f"seed={seed}",
                               f"trial_name={trial}"], env=os.environ.copy(), check=False)
        wall = (time.perf_counter() - started) / 60
        load += "; " + " / ".join(f"{x:.1f}" for x in os.getloadavg())
        r = read_run(Path(cfg.fileroot) / cfg.experiment_name / trial / "logs" / "metrics.jsonl",
                     answer_rule(cfg))
        lift = r["after"] - r["before"] if {"before", "after"} <= r.keys() else None
        if lift is not None:
            lifts.append(lift)
        ok &= proc.returncode == 0
        lines.append(f"| {seed} | {r.get('before', float('nan')):.3f} | "
                     f"{r.get('after', float('nan')):.3f} | "
                     f"{'n/a' if lift is None else f'{lift:+.3f}'} | "
                     f"{r.get('format_full_before', float('nan')):.2f} -> "
                     f"{r.get('format_full_after', float('nan')):.2f} | "
                     f"{r.get('format_before', float('nan')):.2f} -> "
                     f"{r.get('format_after', float('nan')):.2f} | {int(r.get('steps', 0))} | "
                     f"{wall:.1f} | {load} | {proc.returncode} |")
    if lifts:
        spread = statistics.stdev(lifts) if len(lifts) > 1 else 0.0
        lines.append(f"\nRL lift over {len(lifts)} of {len(seed_list)} runs: mean "
                     f"{statistics.mean(lifts):+.3f}, sample std {spread:.3f}, "
                     f"min {min(lifts):+.3f}, max {max(lifts):+.3f}; lift > 0 in "
                     f"{sum(x > 0 for x in lifts)} of {len(lifts)}")
    report = "\n".join(lines)
    print(report, flush=True)
    out = Path(cfg.fileroot) / cfg.experiment_name / f"{cfg.trial_name}-seeds.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report + "\n")
    return ok


if __name__ == "__main__":
    if any(a.startswith("seed=") and "," in a for a in sys.argv[1:]):
        sys.exit(0 if seeds(sys.argv[1:]) else 1)
    main(sys.argv[1:])
