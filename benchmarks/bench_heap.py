"""What glibc's mmap threshold costs an update: `Actor.update` with the allocator as it comes and
with the 1 MiB `M_MMAP_THRESHOLD` relayrl used to set (every tensor over 1 MiB its own mmap).

Run by hand:  python benchmarks/bench_heap.py [--rounds 2] [--updates 3]

Each arm runs in its own process (the threshold is process-wide), arms alternating for
`--rounds` rounds; a process times `--updates` updates of bench_train's 16-row batch after one
warm-up and reports the best wall time with its system time, user time and minor page faults
(getrusage). Prints a markdown table; nothing is written.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("glibc default", "1 MiB mmap threshold")
M_MMAP_THRESHOLD = -3


def child(arm: str, updates: int) -> None:
    """One process: set the arm's allocator option, then time updates; prints one JSON line."""
    if arm == ARMS[1]:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if not libc.mallopt(M_MMAP_THRESHOLD, 1 << 20):
            raise SystemExit("mallopt failed: not glibc?")
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_train import synthetic_batch

    from relayrl.train.actor import Actor
    from relayrl.train.advantages import compute_advantages
    from relayrl.train.config import TrainConfig

    torch.set_num_threads(2)
    cfg = TrainConfig(micro_batch_tokens=2048)  # the main job's budget
    actor = Actor("smollm2-135m-instruct", cfg)
    batch = synthetic_batch(16, actor.model.config.vocab_size)
    adv_B_T = compute_advantages(batch, cfg).adv_B_T
    actor.update(batch, adv_B_T)  # warm-up
    runs = []
    for _ in range(updates):  # bounded by --updates
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        actor.update(batch, adv_B_T)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        runs.append({"wall": wall, "sys": after.ru_stime - before.ru_stime,
                     "user": after.ru_utime - before.ru_utime,
                     "faults": after.ru_minflt - before.ru_minflt})
    best = min(runs, key=lambda r: r["wall"])
    best["maxrss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(json.dumps(best), flush=True)


def main() -> None:
    """Alternate the arms' processes and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.updates)
        return
    load = [os.getloadavg()[0]]
    rows = []
    for r in range(args.rounds):  # bounded by --rounds
        for arm in ARMS:
            print(f"round {r + 1}/{args.rounds}: {arm} ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--child", arm, "--updates",
                                  str(args.updates)], capture_output=True, text=True, check=True,
                                 timeout=1800)
            rows.append((r + 1, arm, json.loads(out.stdout.strip().splitlines()[-1])))
    load.append(os.getloadavg()[0])
    print(f"load average (1 min) before/after: {load[0]:.2f} / {load[1]:.2f}")
    print("| round | allocator | update s | system s | user s | minor faults | peak RSS GB |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r, arm, m in rows:
        print(f"| {r} | {arm} | {m['wall']:.2f} | {m['sys']:.2f} | {m['user']:.2f} | "
              f"{m['faults'] / 1e6:.2f}M | {m['maxrss_gb']:.2f} |")


if __name__ == "__main__":
    main()
