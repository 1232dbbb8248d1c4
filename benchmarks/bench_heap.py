"""What glibc's allocator options cost an update: `Actor.update` with the allocator as it comes,
with the heap kept (`relayrl.heap.keep_freed_heap`, the default since 2026-11-28: one
arena, no trimming, no mmap) and with the 1 MiB `M_MMAP_THRESHOLD` relayrl set before
2026-11-25 (every tensor over 1 MiB its own mmap).

Run by hand:  python -m benchmarks heap [--rounds 2] [--updates 3] [--rows agent|random]
              [--arms "glibc default" "kept heap" ...]

Each arm runs in its own process (the options are process-wide and set before any thread
starts), arms alternating for `--rounds` rounds, their order reversed every other round. A
process loads the default model with the default `TrainConfig` and runs every update on one
worker thread, as the trainer does (a thread's arena is where glibc's defaults differ most from
the main thread's); it times `--updates` updates of bench_train's 16 agent rows (or its random
rows) after one warm-up and reports each update's wall time, system time and minor page faults
(getrusage) and the peak RSS. Prints a markdown table; nothing is written.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import resource
import statistics
import time

from benchmarks import harness

NAME = "heap"
ARMS = ("glibc default", "kept heap", "1 MiB mmap threshold")
M_MMAP_THRESHOLD = -3


def child(arm: str, updates: int, rows: str, model: str, n_rows: int = 16) -> None:
    """One process: set the arm's allocator options, then time updates; prints one JSON line."""
    if arm == "kept heap":
        from relayrl.heap import keep_freed_heap

        if not keep_freed_heap():
            raise SystemExit("mallopt failed: not glibc?")
    elif arm == "1 MiB mmap threshold":
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if not libc.mallopt(M_MMAP_THRESHOLD, 1 << 20):
            raise SystemExit("mallopt failed: not glibc?")
    from benchmarks.update_worker import UpdateWorker
    from relayrl.train.config import TrainConfig

    worker = UpdateWorker(model, TrainConfig())
    worker.prepare(n_rows, rows)
    runs = []
    for _ in range(updates):  # bounded by --updates
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        worker.update()
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        runs.append({"wall": wall, "sys": after.ru_stime - before.ru_stime,
                     "faults": after.ru_minflt - before.ru_minflt})
    worker.close()
    print(json.dumps({"runs": runs,
                      "maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}),
          flush=True)


def main(argv: list[str] | None = None) -> None:
    """Alternate the arms' processes and print the table."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--rows", choices=("agent", "random"), default="agent")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS[:2]))
    ap.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--batch-rows", type=int, default=16, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.updates < 1:
        ap.error("--rounds and --updates must be at least 1")
    if args.child:
        child(args.child, args.updates, args.rows, args.model, args.batch_rows)
        return
    if args.smoke:
        args.model, args.rounds, args.updates, args.batch_rows = harness.smoke_model(), 1, 1, 4
    run = harness.Run.start(NAME, args, argv)
    rows = harness.alternate(NAME, {arm: ["--child", arm, "--updates", str(args.updates),
                                          "--rows", args.rows, "--model", args.model,
                                          "--batch-rows", str(args.batch_rows)]
                                    for arm in args.arms}, args.rounds, 1800)
    run.say(f"load average (1 min) before/after: {run.load()}")
    run.say("| round | allocator | update s, each | system s, each | minor faults, each "
            "| peak RSS GB |")
    run.say("| ---: | --- | ---: | ---: | ---: | ---: |")
    for r, arm, m in rows:
        walls = " ".join(f"{u['wall']:.2f}" for u in m["runs"])
        system = " ".join(f"{u['sys']:.2f}" for u in m["runs"])
        faults = " ".join(f"{u['faults'] / 1e3:.0f}k" for u in m["runs"])
        run.say(f"| {r} | {arm} | {walls} | {system} | {faults} | {m['maxrss_gb']:.2f} |")
    # the first timed update is slower in every arm (it still grows the heap, as its faults show)
    later = {arm: statistics.median(u["wall"] for _, a, m in rows if a == arm
                                    for u in (m["runs"][1:] or m["runs"])) for arm in args.arms}
    base = later[args.arms[0]]
    run.say("median update s after the first timed one: " + ", ".join(
        f"{arm} {s:.2f} ({base / s:.2f}x {args.arms[0]})" for arm, s in later.items()))
    run.finish(metrics={"median_update_s": later,
                        "rounds": [{"round": r, "arm": arm, **m} for r, arm, m in rows]})


if __name__ == "__main__":
    main()
