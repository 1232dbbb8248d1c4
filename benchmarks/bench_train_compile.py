"""`train.compile` on the default update path: agent rows with shared prefixes, compiled vs eager.

Run by hand:  RELAYRL_HOME=/tmp/rr python -m benchmarks train-compile [--rounds 6]
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

import statistics

import torch
from tqdm import tqdm

from benchmarks import harness
from benchmarks.bench_train import agent_batch, update_fn
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig

NAME = "train-compile"


def main(argv: list[str] | None = None) -> None:
    """Time the rounds and print them."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    n_rows = 16
    if args.smoke:  # torch.compile's first step still compiles: the longest smoke
        args.model, args.rounds, n_rows = harness.smoke_model(), 1, 2
    run = harness.Run.start(NAME, args, argv)
    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    configs = {"eager": TrainConfig(), "compiled": TrainConfig(compile=True)}
    actors = {name: Actor(path, cfg) for name, cfg in configs.items()}
    batch = agent_batch(n_rows, actors["eager"].model.config.vocab_size)
    fns = {name: update_fn(actors[name], batch, cfg) for name, cfg in configs.items()}
    with tqdm(total=2 * (args.rounds + 1), desc="bench_train_compile", unit="update") as bar:
        timed = harness.timed_rounds(fns, args.rounds, each=lambda *_: bar.update(1))
    seconds, warm_up = timed.seconds, timed.warmup_s
    ratios = harness.per_round_ratios(seconds["eager"], seconds["compiled"])
    tokens = int(batch.lengths_B.sum())
    run.say(f"bf16: {actors['eager'].bf16}")
    run.say(f"load average before {run.load_before:.2f}, after {harness.load_average():.2f}")
    run.say(f"warm-up update: eager {warm_up['eager']:.1f} s, compiled {warm_up['compiled']:.1f} s "
          "(tracing and compiling)")
    run.say("| round | eager s | compiled s | eager / compiled |")
    run.say("| ---: | ---: | ---: | ---: |")
    for i, (e, c) in enumerate(zip(seconds["eager"], seconds["compiled"], strict=True), 1):
        run.say(f"| {i} | {e:.2f} | {c:.2f} | {e / c:.3f} |")
    run.say(f"median ratio {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
          f"{max(ratios):.3f}); best tokens/s: eager {tokens / min(seconds['eager']):.0f}, "
            f"compiled {tokens / min(seconds['compiled']):.0f}")
    run.finish(metrics={"seconds": seconds, "warmup_s": warm_up})


if __name__ == "__main__":
    main()
