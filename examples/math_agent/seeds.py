"""The main job over several seeds, one after the other, each in its own process.

    python examples/math_agent/train.py seed=1,2,3 [dotted.overrides ...]
    python examples/math_agent/seeds.py seed=1,2,3 [dotted.overrides ...]   # the same

Each seed runs `train.py seed=N trial_name=<trial>-seedN` (a fresh process: no engine, thread or
heap state carries from one run to the next), then the held-out results of every run are read
back from its `metrics.jsonl` and printed as a Markdown table with the mean and spread of the RL
lift (after RL minus before RL). The table and the raw numbers are also written to
`<fileroot>/<experiment>/<trial>-seeds.{md,json}`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class SeedRun:
    """One seed's held-out results, read from its metrics."""

    seed: int
    returncode: int
    wall_min: float
    base: float | None = None
    before: float | None = None
    after: float | None = None
    tool_rate_before: float | None = None
    tool_rate_after: float | None = None
    steps: int = 0
    batches_without_signal: int = 0
    set_aside_groups: int = 0
    sampled_before: float | None = None
    """Held-out reward before RL at the training settings (`eval.sampled` episodes a question)."""
    sampled_after: float | None = None
    """The same after RL."""

    @property
    def lift(self) -> float | None:
        """Held-out reward after RL minus before RL."""
        if self.before is None or self.after is None:
            return None
        return self.after - self.before

    @property
    def sampled_lift(self) -> float | None:
        """The same lift at the training settings, where `eval.sampled` was set."""
        if self.sampled_before is None or self.sampled_after is None:
            return None
        return self.sampled_after - self.sampled_before


def split_seeds(argv: list[str]) -> tuple[list[int], list[str]]:
    """The seeds of a `seed=1,2,3` argument and the other arguments."""
    seeds: list[int] = []
    rest: list[str] = []
    for arg in argv:
        if arg.startswith("seed="):
            seeds = [int(s) for s in arg.removeprefix("seed=").split(",") if s.strip()]
        else:
            rest.append(arg)
    if not seeds:
        raise SystemExit("give the seeds as seed=1,2,3")
    return seeds, rest


def read_run(seed: int, returncode: int, wall_s: float, metrics: Path) -> SeedRun:
    """A finished run's results from its metrics.jsonl (the last record holds the evals)."""
    if not metrics.is_file():
        return SeedRun(seed, returncode, wall_s / 60)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    final = next((r for r in reversed(records) if "eval_reward_after" in r), {})
    steps = [r for r in records if "loss" in r]
    last = steps[-1] if steps else {}

    def get(key: str) -> float | None:
        return float(final[key]) if key in final else None

    return SeedRun(
        seed, returncode, wall_s / 60, base=get("eval_reward_base"),
        before=get("eval_reward_before"), after=get("eval_reward_after"),
        tool_rate_before=get("eval_tool_call_rate_before"),
        tool_rate_after=get("eval_tool_call_rate_after"), steps=len(steps),
        batches_without_signal=int(last.get("skipped_batches", 0)),
        set_aside_groups=int(last.get("set_aside_groups", 0)),
        sampled_before=get("eval_reward_before_sampled"),
        sampled_after=get("eval_reward_after_sampled"))


def table(runs: list[SeedRun]) -> str:
    """The runs and the mean (± sample std) of each column, as Markdown."""
    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    lines = ["| seed | base | before RL | after RL | lift | sampled before → after (lift) | "
             "tool-call rate before → after | "
             "steps | batches w/o signal | groups set aside | wall min | exit |",
             "| ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: "
             "| ---: |"]
    for r in runs:
        sampled = ("n/a" if r.sampled_lift is None else
                   f"{f(r.sampled_before)} → {f(r.sampled_after)} ({r.sampled_lift:+.3f})")
        lines.append(f"| {r.seed} | {f(r.base)} | {f(r.before)} | {f(r.after)} | {f(r.lift)} | "
                     f"{sampled} | "
                     f"{f(r.tool_rate_before)} → {f(r.tool_rate_after)} | {r.steps} | "
                     f"{r.batches_without_signal} | {r.set_aside_groups} | "
                     f"{r.wall_min:.1f} | "
                     f"{r.returncode} |")
    lifts = [r.lift for r in runs if r.lift is not None]
    if lifts:
        spread = statistics.stdev(lifts) if len(lifts) > 1 else 0.0
        lines.append(f"\nRL lift over {len(lifts)} of {len(runs)} runs: mean {statistics.mean(lifts):+.3f}"
                     f", sample std {spread:.3f}, min {min(lifts):+.3f}, max {max(lifts):+.3f}")
    sampled = [r.sampled_lift for r in runs if r.sampled_lift is not None]
    if sampled:
        spread = statistics.stdev(sampled) if len(sampled) > 1 else 0.0
        lines.append(f"Sampled lift (training settings) over {len(sampled)} runs: mean "
                     f"{statistics.mean(sampled):+.3f}, sample std {spread:.3f}, "
                     f"min {min(sampled):+.3f}, max {max(sampled):+.3f}")
    return "\n".join(lines)


def main(argv: list[str]) -> list[SeedRun]:
    """Run train.py once per seed, in turn, and report every run and the mean."""
    from relayrl.config import RelayConfig, load_config

    seeds, rest = split_seeds(argv)
    cfg = load_config(RelayConfig, HERE / "config.yaml", rest)
    runs: list[SeedRun] = []
    for seed in seeds:
        trial = f"{cfg.trial_name}-seed{seed}"
        print(f"== seed {seed}: trial {trial}", flush=True)
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, str(HERE / "train.py"), *rest, f"seed={seed}",
                               f"trial_name={trial}"], env=os.environ.copy(), check=False)
        metrics = Path(cfg.fileroot) / cfg.experiment_name / trial / "logs" / "metrics.jsonl"
        runs.append(read_run(seed, proc.returncode, time.perf_counter() - started, metrics))
    report = table(runs)
    print(report, flush=True)
    out = Path(cfg.fileroot) / cfg.experiment_name / f"{cfg.trial_name}-seeds"
    out.with_suffix(".md").write_text(report + "\n")
    out.with_suffix(".json").write_text(json.dumps(
        [asdict(r) | {"lift": r.lift, "sampled_lift": r.sampled_lift} for r in runs], indent=2))
    return runs


if __name__ == "__main__":
    sys.exit(0 if all(r.returncode == 0 for r in main(sys.argv[1:])) else 1)
