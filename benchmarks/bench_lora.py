"""Ways to train with less against training every weight as it is: LoRA adapters
(`train.lora_rank`), frozen lower layers (`train.freeze_layers`), gradient checkpointing
(`train.gradient_checkpointing`). An update's time and the process's peak memory, interleaved.

Run by hand:  python -m benchmarks lora [--model NAME] [--rank 16] [--freeze N]
              [--checkpointing] [--rounds 2] [--updates 2] [--micro-batch-tokens 4096]

Each arm runs in its own process (so that its peak RSS is its own), arms alternating for
`--rounds` rounds, their order reversed every other round. A process keeps its freed heap (as a
launched run does), loads the model with the default `TrainConfig` plus its arm's setting
(`--rank 0` leaves the LoRA arm out; `--freeze N` and `--checkpointing` add theirs), runs
every update on one worker thread with 2 torch threads as the trainer does, and times
`--updates` updates of bench_train's 16 agent rows after one warm-up, then the weights' way to
the engine (`state_dict_for_engine`: free for full training, adapters folded in for LoRA).
Printed: each update's seconds, the push's, the RSS after loading and the peak RSS, and the
median update's ratio. Nothing is written. tests/train/test_lora.py, test_freeze.py and
test_checkpointing.py check what the arms compute; this measures only their cost.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from typing import Any

from benchmarks import harness

NAME = "lora"


def rss_gb() -> float:
    """The process's resident set now, GB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def child(model: str, overrides: dict[str, Any], updates: int, micro_batch_tokens: int,
          n_rows: int = 16) -> None:
    """One process: load, warm up, time updates and a push; prints one JSON line."""
    from relayrl.heap import keep_freed_heap

    keep_freed_heap()
    from benchmarks.update_worker import UpdateWorker
    from relayrl.train.config import TrainConfig

    worker = UpdateWorker(model, TrainConfig(micro_batch_tokens=micro_batch_tokens, **overrides))
    loaded = rss_gb()
    worker.prepare(n_rows)
    walls = []
    for _ in range(updates):  # bounded by --updates
        started = time.perf_counter()
        metrics = worker.update()
        walls.append(time.perf_counter() - started)
    actor = worker.actor
    started = time.perf_counter()
    state = worker.run(actor.state_dict_for_engine)
    push = time.perf_counter() - started
    del state
    worker.close()
    trained = sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"])
    print(json.dumps({"walls": walls, "push": push, "loaded_gb": loaded, "trained": trained,
                      "forward_tokens": metrics["forward_tokens"],
                      "maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}),
          flush=True)


def main(argv: list[str] | None = None) -> None:
    """Alternate the arms' processes and print the table."""
    from relayrl.models import DEFAULT_MODEL

    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rank", type=int, default=16, help="the LoRA arm's lora_rank; 0: no LoRA arm")
    ap.add_argument("--freeze", type=int, default=0,
                    help="also an arm with train.freeze_layers=N (0: none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096,
                    help="train.micro_batch_tokens of both arms (activations' share of memory)")
    ap.add_argument("--checkpointing", action="store_true",
                    help="also an arm with train.gradient_checkpointing")
    ap.add_argument("--child-config", help=argparse.SUPPRESS)
    ap.add_argument("--batch-rows", type=int, default=16, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.updates < 1 or args.rank < 0 or args.freeze < 0:
        ap.error("--rounds and --updates must be at least 1, --rank and --freeze at least 0")
    if args.child_config is not None:
        child(args.model, json.loads(args.child_config), args.updates, args.micro_batch_tokens,
              args.batch_rows)
        return
    if args.smoke:
        args.model, args.rank, args.rounds, args.updates, args.batch_rows = (
            harness.smoke_model(), 4, 1, 1, 4)
    arms: dict[str, dict[str, Any]] = {"all weights": {}}
    if args.rank:
        arms[f"LoRA r={args.rank}"] = {"lora_rank": args.rank}
    if args.freeze:
        arms[f"{args.freeze} layers frozen"] = {"freeze_layers": args.freeze}
    if args.checkpointing:
        arms["gradient checkpointing"] = {"gradient_checkpointing": True}
    if len(arms) == 1:
        ap.error("nothing to compare: --rank 0 and no other arm")
    run = harness.Run.start(NAME, args, argv)
    rows = harness.alternate(NAME, {arm: ["--child-config", json.dumps(overrides),
                                          "--model", args.model, "--updates", str(args.updates),
                                          "--micro-batch-tokens", str(args.micro_batch_tokens),
                                          "--batch-rows", str(args.batch_rows)]
                                    for arm, overrides in arms.items()}, args.rounds, 3600)
    run.say(f"model {args.model}, micro_batch_tokens {args.micro_batch_tokens}; "
            f"load average (1 min) before/after: {run.load()}")
    run.say("| round | arm | trained parameters | update s, each | push to engine s "
            "| RSS after load GB | peak RSS GB |")
    run.say("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r, arm, m in rows:
        walls = " ".join(f"{w:.2f}" for w in m["walls"])
        run.say(f"| {r} | {arm} | {m['trained'] / 1e6:.1f}M | {walls} | {m['push']:.2f} "
              f"| {m['loaded_gb']:.2f} | {m['maxrss_gb']:.2f} |")
    median = {arm: statistics.median(w for _, a, m in rows if a == arm for w in m["walls"])
              for arm in arms}
    full = median["all weights"]
    tokens = rows[0][2]["forward_tokens"]
    run.say(f"forward tokens an update: {tokens:.0f}; median update s: " + ", ".join(
        f"{arm} {s:.2f}" for arm, s in median.items()) + "; all weights / arm: " + ", ".join(
        f"{arm} {full / s:.2f}x" for arm, s in median.items() if arm != "all weights"))
    run.finish(metrics={"median_update_s": median,
                        "rounds": [{"round": r, "arm": arm, **m} for r, arm, m in rows]})


if __name__ == "__main__":
    main()
