"""What the router adds to a call: the same session's calls sent directly to its gateway and
through the router, interleaved, one at a time, on loopback.

Two FakeEngine gateways (`relayrl gateway --engine fake`) and the router (`relayrl.router.cli`)
run as their own processes, as in production; this process is the client (httpx, keep-alive).
Prints the markdown section ("## Router overhead") and writes it through the harness's results
writer: the machine, the load average at start and end, the event loop and HTTP parser the
servers ran on, p50/p90/p99 latency per path, the router's p50 overhead and its CPU per call.
`--baseline-src DIR` also runs the router of another checkout (its `src`), in front of the same
gateway with its own session, as a third path interleaved with the other two: old and new router
measured in the same run. `--smoke`: a handful of calls.

    python -m benchmarks router --calls 400 [--baseline-src ../main/src]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from benchmarks import harness

NAME = "router"

ADMIN = "bench-admin-key"
SRC = str(harness.ROOT / "src")


def _spawn(stack: ExitStack, args: list[str], src: str = SRC) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, *args], env=harness.child_env(src),
                            stdout=subprocess.DEVNULL)
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    return proc


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (from /proc; load does not inflate it)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


HEADING = "## Router overhead (direct vs through `relayrl router`)"


def _stack() -> str:
    from importlib.metadata import version

    from relayrl.asgi import uvicorn_options

    opts = uvicorn_options()
    return (f"gateways and the router on uvicorn {version('uvicorn')} (loop {opts['loop']}, "
            f"parser {opts['http']}), the router relaying with aiohttp {version('aiohttp')}, "
            f"starlette {version('starlette')}")


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, print its section and write it."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--calls", type=int, default=400, help="calls per path and kind")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--baseline-src", default=None, metavar="DIR",
                    help="also time the router of this source tree (another checkout's src)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.calls = 6
    run = harness.Run.start(NAME, args, argv)
    load0 = os.getloadavg()
    with ExitStack() as stack:
        gateways, procs = [], {}
        for _ in range(2):
            port = harness.free_port()
            procs[f"http://127.0.0.1:{port}"] = _spawn(stack, ["-m", "relayrl.cli", "gateway", "--engine", "fake", "--model",
                           args.model, "--port", str(port), "--admin-key", ADMIN])
            gateways.append(f"http://127.0.0.1:{port}")
        rport = harness.free_port()
        router_proc = _spawn(stack, ["-m", "relayrl.router.cli", "--port", str(rport),
                       *[a for g in gateways for a in ("--backend", g)]])
        router = f"http://127.0.0.1:{rport}"
        for url in [*gateways, router]:
            _wait(url)
        auth = {"authorization": f"Bearer {ADMIN}"}
        client = stack.enter_context(httpx.Client(timeout=30))
        s = client.post(router + "/rl/v1/start_session", json={}, headers=auth).json()
        key = s["api_key"]
        owner = next(g for g in gateways if client.post(
            g + "/export_trajectories", json={"session_id": s["session_id"]},
            headers=auth).status_code == 200)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        kinds = {"chat": body, "chat, streamed": {**body, "stream": True}}
        # path -> (root URL, session key, process whose CPU is counted)
        paths = {"direct": (owner, key, None), "router": (router, key, router_proc)}
        if args.baseline_src:
            # the same gateway only, so the baseline's session lands beside the other one
            bport = harness.free_port()
            base_proc = _spawn(stack, ["-m", "relayrl.router.cli", "--port", str(bport),
                                       "--backend", owner], src=args.baseline_src)
            baseline = f"http://127.0.0.1:{bport}"
            _wait(baseline)
            bkey = client.post(baseline + "/rl/v1/start_session", json={},
                               headers=auth).json()["api_key"]
            paths["baseline router"] = (baseline, bkey, base_proc)
        lat: dict[tuple[str, str], list[float]] = {}
        for _ in range(20):  # warm every path's connections
            for base, k, _proc in paths.values():
                client.post(base + "/v1/chat/completions", json=body,
                            headers={"authorization": f"Bearer {k}"})
        cpu0 = {name: _cpu_s(p.pid) for name, (_, _, p) in paths.items() if p is not None}
        gcpu0 = _cpu_s(procs[owner].pid)
        names = list(paths)
        for i in range(args.calls):
            for kind, b in kinds.items():
                j = i % len(names)
                order = names[j:] + names[:j]  # each path first, middle and last in turn
                for name in (order if (i // len(names)) % 2 else order[::-1]):
                    base, k, _proc = paths[name]
                    t0 = time.perf_counter()
                    with client.stream("POST", base + "/v1/chat/completions", json=b,
                                       headers={"authorization": f"Bearer {k}"}) as r:
                        r.read()
                        assert r.status_code == 200
                    lat.setdefault((kind, name), []).append((time.perf_counter() - t0) * 1e3)
        calls = args.calls * len(kinds)
        cpu_ms = {name: (_cpu_s(paths[name][2].pid) - c0) * 1e3 / calls  # type: ignore[union-attr]
                  for name, c0 in cpu0.items()}
        gateway_ms = (_cpu_s(procs[owner].pid) - gcpu0) * 1e3 / (len(names) * calls)
    load1 = os.getloadavg()
    out = [HEADING, "",
           f"Command: `PYTHONPATH=$PWD/src {run.command}`  ",
           f"Machine: {harness.machine().describe()}; {_stack()}.  ",
           f"Date: {run.started}. Load average (1, 5, 15 min): "
           f"{load0[0]:.2f}, {load0[1]:.2f}, {load0[2]:.2f} at the start; "
           f"{load1[0]:.2f}, {load1[1]:.2f}, {load1[2]:.2f} at the end.",
           "Two FakeEngine gateways and the router each in their own process, the client (httpx, "
           "keep-alive) in the benchmark's; one session, its calls sent one at a time, direct and "
           "routed interleaved (order rotating), `max_tokens: 8`."
           + (" The baseline router (the other checkout's) fronts the same gateway, with its own "
              "session there." if args.baseline_src else ""), "",
           "| call | path | calls | p50 ms | p90 ms | p99 ms |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for (kind, name), xs in lat.items():
        out.append(f"| {kind} | {name} | {len(xs)} | {statistics.median(xs):.2f} | "
                   f"{harness.percentile(xs, 0.9):.2f} | {harness.percentile(xs, 0.99):.2f} |")
    out.append("")
    for kind in kinds:
        d = lat[(kind, "direct")]
        for name in names[1:]:
            r = lat[(kind, name)]
            paired = [b - a for a, b in zip(d, r, strict=True)]
            out.append(f"{kind}: {name} p50 - direct p50 = "
                       f"{statistics.median(r) - statistics.median(d):.2f} ms; "
                       f"median of paired differences = {statistics.median(paired):.2f} ms.  ")
        if "baseline router" in names:
            r, b0 = lat[(kind, "router")], lat[(kind, "baseline router")]
            paired = [x - y for x, y in zip(r, b0, strict=True)]
            out.append(f"{kind}: router - baseline router, median of paired differences = "
                       f"{statistics.median(paired):.2f} ms.  ")
    for name, ms in cpu_ms.items():
        out.append(f"{name.capitalize()} process CPU per routed call (user + system, health checks "
                   f"included): {ms:.2f} ms.  ")
    out.append(f"The gateway's CPU per call (all paths): {gateway_ms:.2f} ms.")
    section = "\n".join(out) + "\n"
    print(section)
    run.finish(section, {f"{kind}, {name}": statistics.median(xs)
                         for (kind, name), xs in lat.items()})


if __name__ == "__main__":
    main()
