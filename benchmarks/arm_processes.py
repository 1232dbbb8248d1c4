"""Arms that each run in a fresh process, alternating round by round (bench_heap, bench_lora).

A process per arm keeps what is process-wide its own: allocator options set before any thread,
peak RSS. No torch here: the parent only starts the children.
"""

from __future__ import annotations

import json
import subprocess
import sys


def alternate(script: str, arms: dict[str, list[str]], rounds: int,
              timeout_s: float) -> list[tuple[int, str, dict]]:
    """Run `script` with each arm's arguments once a round, the order reversed every other round.

    Each child prints one JSON line last; returns (round, arm, that JSON) in the order run.
    """
    names = list(arms)
    rows = []
    for r in range(rounds):  # bounded by rounds
        for arm in names if r % 2 == 0 else names[::-1]:
            print(f"round {r + 1}/{rounds}: {arm} ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, script, *arms[arm]], capture_output=True,
                                 text=True, check=True, timeout=timeout_s)
            rows.append((r + 1, arm, json.loads(out.stdout.strip().splitlines()[-1])))
    return rows
