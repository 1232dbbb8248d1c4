"""How LocalEngine's decode step degrades when another process competes for the cores.

Run by hand:  python -m benchmarks contention [--concurrent 8] [--new-tokens 48] [--rounds 3]

For each torch thread setting of the engine (1 and 2) and OpenMP wait policy (unset: the
runtime's default; ACTIVE spins at barriers; PASSIVE sleeps), the engine decodes `--concurrent` requests alone, then again while a
competing CPU-bound process (one busy Python loop, like a tokenizer or an agent's tool on the
same machine) runs. It prints ms per decode step for both and their ratio, interleaved over
`--rounds` rounds, with the load average before each run. A proportional slowdown with one
competitor on two cores is about 1.0-2.0x; spinning OpenMP barriers showed 20x (57 ms -> 1.3 s).

Each setting runs in its own subprocess, because OpenMP reads its wait policy once at start.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import time

from benchmarks import harness

NAME = "contention"

SETTINGS = [(t, policy) for t in (1, 2) for policy in ("unset", "PASSIVE", "ACTIVE")]
"""(torch threads, OMP_WAIT_POLICY); "unset" is what a user gets: the OpenMP runtime's default."""


def _burn(stop: mp.Event) -> None:  # type: ignore[valid-type]
    """A competing CPU-bound process: a pure Python loop, until told to stop."""
    x = 0
    while not stop.is_set():  # bounded by the parent, which sets stop after one measurement
        for i in range(100_000):
            x ^= i


def _measure(model: str, threads: int, concurrent: int, new_tokens: int) -> float:
    """ms per decode step of `concurrent` greedy requests (runs in a fresh subprocess)."""
    import asyncio

    from relayrl.engine.local import LocalEngine
    from relayrl.models import model_path
    from relayrl.types import GenerateRequest, SamplingParams

    async def run() -> float:
        engine = LocalEngine(model_path(model), num_threads=threads)
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        prompt = list(range(100, 140))
        await engine.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=4)))
        start = time.perf_counter()
        await asyncio.gather(*(engine.generate(GenerateRequest(prompt, params))
                               for _ in range(concurrent)))
        elapsed = time.perf_counter() - start
        await engine.aclose()
        return 1000 * elapsed / new_tokens

    return asyncio.run(run())


def _child(args: argparse.Namespace) -> None:
    print(json.dumps({"ms_per_step": _measure(args.model, args.threads, args.concurrent,
                                              args.new_tokens)}))


def _run_setting(threads: int, policy: str, args: argparse.Namespace, compete: bool) -> float:
    stop = mp.Event()
    burner = mp.Process(target=_burn, args=(stop,), daemon=True) if compete else None
    if burner is not None:
        burner.start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if policy != "unset":
            env["OMP_WAIT_POLICY"] = policy
        out = subprocess.run(harness.child_command(
            NAME, "--child", "--threads", str(threads), "--concurrent", str(args.concurrent),
            "--new-tokens", str(args.new_tokens), "--model", args.model),
            capture_output=True, text=True, env=harness.child_env(base=env), timeout=900,
            check=True)
        return float(json.loads(out.stdout.strip().splitlines()[-1])["ms_per_step"])
    finally:
        stop.set()
        if burner is not None:
            burner.join(10)


def main(argv: list[str] | None = None) -> None:
    """Interleaved rounds over the settings; prints one table row per setting."""
    p = harness.parser(NAME, __doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrent", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return
    settings = SETTINGS
    if args.smoke:  # one setting, alone and beside its competitor
        settings, args.model, args.concurrent, args.new_tokens, args.rounds = (
            SETTINGS[:1], harness.smoke_model(), 2, 4, 1)
    run = harness.Run.start(NAME, args, argv)
    alone: dict[tuple[int, str], list[float]] = {s: [] for s in settings}
    loaded: dict[tuple[int, str], list[float]] = {s: [] for s in settings}
    for r, s in harness.rounds(settings, args.rounds):  # interleaved: every setting once a round
        load = harness.load_average()
        alone[s].append(_run_setting(*s, args, compete=False))
        loaded[s].append(_run_setting(*s, args, compete=True))
        print(f"round {r} threads={s[0]} OMP_WAIT_POLICY={s[1]} load={load:.2f}: "
              f"alone {alone[s][-1]:.1f} ms/step, with a competitor {loaded[s][-1]:.1f}",
              flush=True)
    lines = [f"{args.concurrent} concurrent x {args.new_tokens} tokens, median of {args.rounds}",
             "| torch threads | OMP_WAIT_POLICY | alone ms/step | with 1 competitor | slowdown |",
             "| ---: | --- | ---: | ---: | ---: |"]
    for s in settings:
        a, c = statistics.median(alone[s]), statistics.median(loaded[s])
        lines.append(f"| {s[0]} | {s[1]} | {a:.1f} | {c:.1f} | {c / a:.2f}x |")
    print("\n" + "\n".join(lines))
    run.finish("\n".join(lines), {"alone_ms": {f"{t} {pol}": v for (t, pol), v in alone.items()},
                                 "competing_ms": {f"{t} {pol}": v for (t, pol), v in loaded.items()}})


if __name__ == "__main__":
    main()
