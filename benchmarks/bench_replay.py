"""The SFT replay (PPO-ptx) scored in the RL rows' micro-batches against a pass of its own.

Run by hand:  RELAYRL_HOME=/tmp/rr python benchmarks/bench_replay.py [--rounds 5] [--threads 2]

The main job adds `train.sft_replay_rows` (4) warm-up traces to every RL update. They start
with the agent's system prompt like the RL rows, so `Actor.update` scores them in the RL rows'
micro-batches and the prompt's prefix pass runs once. Arms, on one actor of the default model
with the default `TrainConfig` (`sft_replay_coef` 1), each updating bench_train's agent-shaped
rows (16 RL rows in groups of 8, 4 replay rows of a third question, one 313-token system
prompt):
`one pass` is `update(batch, adv, replay=...)`; `two passes` is the work of the code before it:
`update(batch, adv)` (RL forward, backward and the optimizer step) and then `nll_backward` of
the replay rows in micro-batches of their own (the same forward and backward work as when the
replay ran before the step; its gradients are dropped by the next update). Interleaved rounds
after a warm-up, the order reversed every other round; the process keeps its freed heap as the
launchers set it. Speed only: tests/train/test_actor.py checks the one-pass step against the
two losses taken apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from bench_train import agent_batch, machine
from tqdm import tqdm

from relayrl.heap import keep_freed_heap
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.train.actor import Actor
from relayrl.train.advantages import compute_advantages
from relayrl.train.config import TrainConfig

RL_ROWS, REPLAY_ROWS = 16, 4


def main() -> None:
    """Time the rounds and print them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    keep_freed_heap()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    cfg = TrainConfig(sft_replay_coef=1.0)
    actor = Actor(model_path(args.model), cfg)
    rows = agent_batch(RL_ROWS + REPLAY_ROWS, actor.model.config.vocab_size)
    adv = compute_advantages(rows.select(range(RL_ROWS)), cfg)
    batch, replay = adv.batch, rows.select(range(RL_ROWS, RL_ROWS + REPLAY_ROWS))
    forward: dict[str, int] = {}

    def one_pass() -> None:
        forward["one pass"] = int(actor.update(batch, adv.adv_B_T, replay=replay)["forward_tokens"])

    def two_passes() -> None:
        rl = int(actor.update(batch, adv.adv_B_T)["forward_tokens"])
        actor.nll_backward(replay, cfg.sft_replay_coef)
        forward["two passes"] = rl + sum(mb.num_tokens for mb in actor.micro_batches(replay))

    arms: dict[str, Callable[[], None]] = {"one pass": one_pass, "two passes": two_passes}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    with tqdm(total=len(arms) * (args.rounds + 1), desc="bench_replay", unit="update") as bar:
        for r in range(args.rounds + 1):  # bounded: a warm-up round, then --rounds
            for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                start = time.perf_counter()
                arms[name]()
                if r > 0:
                    seconds[name].append(time.perf_counter() - start)
                bar.update(1)
    print(f"machine: {machine()}; bf16: {actor.bf16}")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print("| round | " + " | ".join(f"{n} s" for n in arms) + " |")
    print("| ---: |" + " ---: |" * len(arms))
    for i in range(args.rounds):
        print(f"| {i + 1} | " + " | ".join(f"{seconds[n][i]:.2f}" for n in arms) + " |")
    ratios = [b / a for a, b in zip(seconds["one pass"], seconds["two passes"], strict=True)]
    for name in arms:
        print(f"{name}: forward tokens {forward[name]}, median {statistics.median(seconds[name]):.2f} s")
    print(f"two passes / one pass per round {', '.join(f'{x:.3f}' for x in ratios)}, "
          f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
