"""What the router adds to a call: the same session's calls sent directly to its gateway and
through the router, interleaved, one at a time, on loopback.

Two FakeEngine gateways (`relayrl gateway --engine fake`) and the router (`relayrl.router.cli`)
run as their own processes, as in production; this process is the client (httpx, keep-alive).
Prints the markdown section for benchmarks/RESULTS.md ("## Router overhead"): the machine, the
load average at start and end, the event loop and HTTP parser the servers ran on, p50/p90/p99
latency per path, the router's p50 overhead and its CPU per call. `--write RESULTS.md` replaces
that section in the file (or appends it).

    python benchmarks/bench_router.py --calls 400 [--write benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

ADMIN = "bench-admin-key"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(stack: ExitStack, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL)
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


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


HEADING = "## Router overhead (direct vs through `relayrl router`)"


def _machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return f"{model}, {os.cpu_count()} cores; Python {platform.python_version()}"


def _stack() -> str:
    from importlib.metadata import version

    from relayrl.asgi import uvicorn_options

    opts = uvicorn_options()
    return (f"uvicorn {version('uvicorn')} (loop {opts['loop']}, parser {opts['http']}), "
            f"router client aiohttp {version('aiohttp')}, starlette {version('starlette')}")


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section of `path` (up to the next `## `), or append it."""
    text = path.read_text() if path.exists() else ""
    pattern = re.compile(r"^## Router overhead.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip("\n") + "\n\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> None:
    """Run the benchmark and print its section (and write it with `--write`)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400, help="calls per path and kind")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--write", default=None, metavar="RESULTS.md",
                    help="replace the '## Router overhead' section of this file")
    args = ap.parse_args()
    load0 = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC)
    with ExitStack() as stack:
        gateways, procs = [], {}
        for _ in range(2):
            port = _free_port()
            procs[f"http://127.0.0.1:{port}"] = _spawn(stack, ["-m", "relayrl.cli", "gateway", "--engine", "fake", "--model",
                           args.model, "--port", str(port), "--admin-key", ADMIN])
            gateways.append(f"http://127.0.0.1:{port}")
        rport = _free_port()
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
        lat: dict[tuple[str, str], list[float]] = {}
        for _ in range(20):  # warm both paths' connections
            for base in (owner, router):
                client.post(base + "/v1/chat/completions", json=body,
                            headers={"authorization": f"Bearer {key}"})
        cpu0, gcpu0 = _cpu_s(router_proc.pid), _cpu_s(procs[owner].pid)
        for i in range(args.calls):
            for kind, b in kinds.items():
                order = [("direct", owner), ("router", router)]
                for name, base in (order if i % 2 else order[::-1]):
                    t0 = time.perf_counter()
                    with client.stream("POST", base + "/v1/chat/completions", json=b,
                                       headers={"authorization": f"Bearer {key}"}) as r:
                        r.read()
                        assert r.status_code == 200
                    lat.setdefault((kind, name), []).append((time.perf_counter() - t0) * 1e3)
        routed = sum(len(xs) for (_, name), xs in lat.items() if name == "router")
        cpu_ms = (_cpu_s(router_proc.pid) - cpu0) * 1e3 / routed
        gateway_ms = (_cpu_s(procs[owner].pid) - gcpu0) * 1e3 / (2 * routed)
    load1 = os.getloadavg()
    out = [HEADING, "",
           f"Command: `PYTHONPATH=$PWD/src python benchmarks/bench_router.py --calls {args.calls}`  ",
           f"Machine: {_machine()}; {_stack()}.  ",
           f"Date: {started:%Y-%m-%d, %H:%M} UTC. Load average (1, 5, 15 min): "
           f"{load0[0]:.2f}, {load0[1]:.2f}, {load0[2]:.2f} at the start; "
           f"{load1[0]:.2f}, {load1[1]:.2f}, {load1[2]:.2f} at the end.",
           "Two FakeEngine gateways and the router each in their own process, the client (httpx, "
           "keep-alive) in the benchmark's; one session, its calls sent one at a time, direct and "
           "routed interleaved (order alternating), `max_tokens: 8`.", "",
           "| call | path | calls | p50 ms | p90 ms | p99 ms |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for (kind, name), xs in lat.items():
        out.append(f"| {kind} | {name} | {len(xs)} | {statistics.median(xs):.2f} | "
                   f"{_pct(xs, 0.9):.2f} | {_pct(xs, 0.99):.2f} |")
    out.append("")
    for kind in kinds:
        d, r = lat[(kind, "direct")], lat[(kind, "router")]
        paired = [b - a for a, b in zip(d, r, strict=True)]
        out.append(f"{kind}: router p50 - direct p50 = "
                   f"{statistics.median(r) - statistics.median(d):.2f} ms; "
                   f"median of paired differences = {statistics.median(paired):.2f} ms.  ")
    out.append(f"Router process CPU per routed call (user + system, health checks included): "
               f"{cpu_ms:.2f} ms; the gateway's CPU per call (direct and routed): "
               f"{gateway_ms:.2f} ms.")
    section = "\n".join(out) + "\n"
    print(section)
    if args.write:
        write_section(Path(args.write), section)
        print(f"(written to {args.write})")

if __name__ == "__main__":
    main()
