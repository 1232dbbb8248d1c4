"""Two relayrl source trees' gateways side by side, with bench_vs_areal's client and rows.

Run by hand:  python benchmarks/bench_gateway_ab.py BASE_SRC NEW_SRC [--rows 1,5,6] [--rounds 4]

A change to the gateway is measured against the code before it in the same run: each tree's
gateway (a `GatewayThread` over a FakeEngine, as in bench_vs_areal) runs in its own process with
`PYTHONPATH` set to that tree's `src` (a git worktree of the base commit, say), and
bench_vs_areal's aiohttp client drives them row by row, interleaved, in alternating order. The
ratio column is NEW / BASE. Prints a Markdown table; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_vs_areal as b  # noqa: E402

from relayrl.models import DEFAULT_MODEL, model_path  # noqa: E402


def main() -> None:
    """Start both gateways, run the rows, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the base tree's src directory")
    ap.add_argument("new", help="the changed tree's src directory")
    ap.add_argument("--rows", default="1,3,4,5,6", help="bench_vs_areal row numbers (1-based)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--episodes", type=int, default=60)
    ap.add_argument("--per-session", type=int, default=8)
    args = ap.parse_args()
    model = str(model_path(DEFAULT_MODEL))
    servers, procs = [], []
    try:
        for name, src in (("new", args.new), ("base", args.base)):
            env = {**os.environ, "PYTHONPATH": f"{Path(src).resolve()}{os.pathsep}{HERE}"}
            proc, url = b.start([sys.executable, b.__file__, "--serve-relayrl", model], env=env)
            procs.append(proc)
            servers.append(b.Server(name, url, "/v1/chat/completions", grant_capacity=False))
        rows = [b.ROWS[int(i) - 1] for i in args.rows.split(",")]
        print(f"load average at the start {os.getloadavg()}", flush=True)
        b._run(b.run_all(servers, rows, args))
        print(f"load average at the end {os.getloadavg()}", flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
