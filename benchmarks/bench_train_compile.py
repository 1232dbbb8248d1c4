"""`train.compile` on the default update path: agent rows with shared prefixes, compiled vs eager.

Run by hand:  RELAYRL_HOME=/tmp/rr python benchmarks/bench_train_compile.py [--rounds 6]
              [--model DIR] [--threads 2]

Two actors on the default model with the default `TrainConfig` (bf16 where the CPU has bf16
units, `share_prefix` on), one with `compile=True`, update bench_train's 16 agent-shaped rows
(one 313-token system prompt, a question per group of 8, tool call, result and answer). Each
actor's first update is its warm-up (for the compiled one: tracing and compiling, timed and
reported); then the two alternate, `--rounds` times, so the machine's load falls on both. Printed:
every round's seconds, the per-round ratio eager / compiled, and their median; with the load
average before and after. Speed only: `tests/train/test_shared_prefix.py` checks the compiled
step's logprobs and gradients against eager.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from bench_train import agent_batch, machine, update_fn
from tqdm import tqdm

from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig


def main() -> None:
    """Time the rounds and print them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    path = model_path(args.model)
    configs = {"eager": TrainConfig(), "compiled": TrainConfig(compile=True)}
    actors = {name: Actor(path, cfg) for name, cfg in configs.items()}
    batch = agent_batch(16, actors["eager"].model.config.vocab_size)
    fns = {name: update_fn(actors[name], batch, cfg) for name, cfg in configs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    warm_up: dict[str, float] = {}
    with tqdm(total=2 * (args.rounds + 1), desc="bench_train_compile", unit="update") as bar:
        for r in range(args.rounds + 1):  # bounded: a warm-up round, then --rounds
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start
                if r == 0:
                    warm_up[name] = elapsed
                else:
                    seconds[name].append(elapsed)
                bar.update(1)
    ratios = [e / c for e, c in zip(seconds["eager"], seconds["compiled"], strict=True)]
    tokens = int(batch.lengths_B.sum())
    print(f"machine: {machine()}; bf16: {actors['eager'].bf16}")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"warm-up update: eager {warm_up['eager']:.1f} s, compiled {warm_up['compiled']:.1f} s "
          "(tracing and compiling)")
    print("| round | eager s | compiled s | eager / compiled |")
    print("| ---: | ---: | ---: | ---: |")
    for i, (e, c) in enumerate(zip(seconds["eager"], seconds["compiled"], strict=True), 1):
        print(f"| {i} | {e:.2f} | {c:.2f} | {e / c:.3f} |")
    print(f"median ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
          f"{max(ratios):.3f}); best tokens/s: eager {tokens / min(seconds['eager']):.0f}, "
          f"compiled {tokens / min(seconds['compiled']):.0f}")


if __name__ == "__main__":
    main()
