"""The router's own CPU per relayed call, in-process: what routing, header handling and the
outbound HTTP client cost, without the run queue of a loaded machine in the number.

One FakeEngine gateway runs in its own process (`relayrl gateway --engine fake`); the router's
ASGI app runs in this process, driven directly (no inbound HTTP server), and each call's CPU is
this process's `time.process_time()` (user + system; waiting for the gateway costs none).
`--profile FILE` writes a cProfile of the routed calls.

    PYTHONPATH=$PWD/src python -m benchmarks router-cpu --calls 500
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import statistics
import time
from typing import Any

from benchmarks import harness
from benchmarks.bench_router import ADMIN, _spawn, _wait
from relayrl.router import Router, RouterConfig

NAME = "router-cpu"


async def _call(app: Any, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
                ) -> tuple[int, bytes]:
    """One request through the ASGI app; its status and whole body."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method, "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-length", str(len(body)).encode()),
                         (b"content-type", b"application/json"), *headers],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {}}
    sent = False
    status, parts = 0, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # a client that stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(parts)


async def run(url: str, calls: int, profile: str | None) -> dict[str, float]:
    """Per-call CPU (ms) of the router for plain and streamed chat calls."""
    router = Router(RouterConfig(backends=[url], health_interval_s=30))
    app = router.app()
    auth = [(b"authorization", f"Bearer {ADMIN}".encode())]
    out: dict[str, float] = {}
    async with router.lifespan(app):
        status, raw = await _call(app, "POST", "/rl/v1/start_session", b"{}", auth)
        assert status == 200, raw
        key = json.loads(raw)["api_key"]
        sess = [(b"authorization", f"Bearer {key}".encode())]
        msg = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        kinds = {"chat": json.dumps(msg).encode(),
                 "chat, streamed": json.dumps({**msg, "stream": True}).encode()}
        prof = cProfile.Profile() if profile else None
        for kind, body in kinds.items():
            for _ in range(min(20, calls)):
                await _call(app, "POST", "/v1/chat/completions", body, sess)
            samples = []
            for _ in range(calls):
                c0 = time.process_time()
                if prof:
                    prof.enable()
                status, raw = await _call(app, "POST", "/v1/chat/completions", body, sess)
                if prof:
                    prof.disable()
                samples.append((time.process_time() - c0) * 1e3)
                assert status == 200, raw
            out[kind] = statistics.mean(samples)
        if prof:
            prof.dump_stats(profile)
    return out


def main(argv: list[str] | None = None) -> None:
    """Start the gateway, measure, print."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--profile", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if args.smoke:
        args.calls = 5
    run_ = harness.Run.start(NAME, args, argv)
    from contextlib import ExitStack

    with ExitStack() as stack:
        port = harness.free_port()
        _spawn(stack, ["-m", "relayrl.cli", "gateway", "--engine", "fake", "--model", args.model,
                       "--port", str(port), "--admin-key", ADMIN])
        url = f"http://127.0.0.1:{port}"
        _wait(url)
        load0 = harness.load_average()
        res = asyncio.run(run(url, args.calls, args.profile))
        load1 = harness.load_average()
    for kind, ms in res.items():
        run_.say(f"{kind}: router CPU per call (in-process, mean of {args.calls}) {ms:.3f} ms")
    run_.say(f"load average (1 min) at start {load0:.2f}, at end {load1:.2f}")
    run_.finish(metrics={"cpu_ms_per_call": res})


if __name__ == "__main__":
    main()
