"""Two relayrl source trees' gateways side by side, with bench_vs_areal's client and rows.

Run by hand:  python -m benchmarks gateway-ab BASE_SRC NEW_SRC [--rows 1,5,6] [--rounds 4]

A change to the gateway is measured against the code before it in the same run: each tree's
gateway (a `GatewayThread` over a FakeEngine, as in vs-areal) runs in its own process with
`PYTHONPATH` set to that tree's `src` (a git worktree of the base commit, say), and vs-areal's
aiohttp client drives them row by row, interleaved, in alternating order. The ratio column is
NEW / BASE. Prints a Markdown table and writes it through the harness's results writer. `--smoke`
runs this checkout's `src` as both trees, two rows at tiny counts.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import bench_vs_areal as b
from benchmarks import harness
from relayrl.models import DEFAULT_MODEL, model_path

NAME = "gateway-ab"


def main(argv: list[str] | None = None) -> None:
    """Start both gateways, run the rows, print the table."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("base", nargs="?", help="the base tree's src directory")
    ap.add_argument("new", nargs="?", help="the changed tree's src directory")
    ap.add_argument("--rows", default="1,3,4,5,6", help="bench_vs_areal row numbers (1-based)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--episodes", type=int, default=60)
    ap.add_argument("--per-session", type=int, default=8)
    args = ap.parse_args(argv)
    if args.smoke:
        here = str(harness.ROOT / "src")
        args.base, args.new = args.base or here, args.new or here
        args.rows, args.rounds, args.requests, args.episodes, args.per_session = (
            "1,4", 1, 12, 2, 4)
    if args.base is None or args.new is None:
        ap.error("BASE_SRC and NEW_SRC are required")
    run = harness.Run.start(NAME, args, argv)
    model = str(model_path(DEFAULT_MODEL))
    servers, procs = [], []
    try:
        for name, src in (("new", args.new), ("base", args.base)):
            env = harness.child_env(str(Path(src).resolve()))
            proc, url = b.start(harness.child_command(b.NAME, "--serve-relayrl", model), env=env)
            procs.append(proc)
            servers.append(b.Server(name, url, "/v1/chat/completions", grant_capacity=False))
        rows = [b.ROWS[int(i) - 1] for i in args.rows.split(",")]
        run.say(f"load average at the start {run.load_before:.2f}")
        b._run(b.run_all(servers, rows, args, run.say))
        run.say(f"load average at the end {harness.load_average():.2f}")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    run.finish()


if __name__ == "__main__":
    main()
