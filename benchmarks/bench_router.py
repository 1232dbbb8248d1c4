"""What the router adds to a call: the same session's calls sent directly to its gateway and
through the router, interleaved, one at a time, on loopback.

Two FakeEngine gateways (`relayrl gateway --engine fake`) and the router (`relayrl.router.cli`)
run as their own processes, as in production; this process is the client (httpx, keep-alive).
Prints a markdown table: p50/p90/p99 latency per path and the router's p50 overhead.

    python benchmarks/bench_router.py --calls 400
"""

from __future__ import annotations

import argparse
import os
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


def main() -> None:
    """Run the benchmark and print its table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=400, help="calls per path and kind")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
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
        print("| call | path | calls | p50 ms | p90 ms | p99 ms |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for (kind, name), xs in lat.items():
            print(f"| {kind} | {name} | {len(xs)} | {statistics.median(xs):.2f} | "
                  f"{_pct(xs, 0.9):.2f} | {_pct(xs, 0.99):.2f} |")
        for kind in kinds:
            d, r = lat[(kind, "direct")], lat[(kind, "router")]
            paired = [b - a for a, b in zip(d, r, strict=True)]
            print(f"\n{kind}: router p50 - direct p50 = "
                  f"{statistics.median(r) - statistics.median(d):.2f} ms; "
                  f"median of paired differences = {statistics.median(paired):.2f} ms")
        print(f"\nrouter process CPU per routed call (user + system, health checks included): "
              f"{cpu_ms:.2f} ms; the gateway's CPU per call (direct and routed): {gateway_ms:.2f} ms")


if __name__ == "__main__":
    main()
