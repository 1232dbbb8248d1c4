"""Gateway throughput and latency with the FakeEngine, loaded by wrk from a separate process.

Run by hand (needs Debian's `wrk`):  python benchmarks/bench_gateway.py [--seconds 5]

For each history length (2, 22, 102 messages), history mode, streaming or not, and concurrency
(1, 8, 32), wrk posts Chat Completions to a gateway subprocess on loopback; every request is a
recorded call in one of 64 sessions. Two history modes, because the gateway caches rendered
prompts of identical conversations (GRPO sends each prompt group_size times):
  - repeated: every request sends the same history (the render cache hits after the first);
  - unique: wrk appends a per-run id and a request counter to the last user message, so no two
    requests share a history (no render-cache hits; earlier turns still hit the tokenizer's
    piece cache, as a growing agent conversation does).
Also measured: the FakeEngine called directly in-process (the baseline for "gateway overhead").
Prints a markdown table for benchmarks/RESULTS.md.

Before/after a change: `--baseline-src DIR` starts a second gateway from another checkout's
`src` (e.g. `git worktree add /tmp/before HEAD~1`, then `--baseline-src /tmp/before/src`) and
runs every row on both, alternating which goes first, `--rounds` times; the table then shows
both medians and the per-round ratio of p50s (baseline / this tree).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ADMIN = "bench-admin"
REPLY = "The result is 42. " * 4
SESSIONS = 64
MARK = "@@REQUEST@@"
"""Where wrk writes its request counter into the body (unique mode)."""
AREAL_RPS, AREAL_P50_C1, AREAL_P50_102 = 205.0, 5.0, 18.6
"""AReaL's gateway on this kind of machine: saturated req/s, p50 ms at c=1, p50 ms at 102 msgs."""


def serve(model_dir: str, port_file: str) -> None:
    """Child process: a gateway over a FakeEngine that always answers REPLY."""
    from relayrl.engine.fake import FakeEngine
    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.server import GatewayThread, build_deps

    engine = FakeEngine([REPLY], tokenizer_path=model_dir)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN, max_sessions=100_000,
                        batch_size=SESSIONS,
                        session_ttl_s=3600)
    gw = GatewayThread(build_deps(cfg, engine=engine)).start()
    Path(port_file).write_text(gw.url)
    try:
        while True:
            time.sleep(1)
    finally:
        gw.stop()


def history(n_messages: int, last: str = "And what is 21 times 2?") -> list[dict]:
    """A tool-free chat of n messages ending with the user turn `last`."""
    msgs = [{"role": "system", "content": "You are a careful assistant that answers briefly."}]
    turn = 0
    while len(msgs) < n_messages - 1:
        msgs.append({"role": "user", "content": f"Question {turn}: what is {turn} plus {turn}?"})
        msgs.append({"role": "assistant", "content": f"{turn} plus {turn} is {2 * turn}."})
        turn += 1
    msgs.append({"role": "user", "content": last})
    return msgs[:n_messages]


LUA = """
local keys = {KEYS}
local head = [==[HEAD]==]
local tail = [==[TAIL]==]
local unique = UNIQUE
local i = 0
request = function()
  i = i + 1
  local headers = {}
  headers["Content-Type"] = "application/json"
  headers["Authorization"] = "Bearer " .. keys[(i % #keys) + 1]
  local body = head .. tail
  if unique then body = head .. i .. tail end
  return wrk.format("POST", "/v1/chat/completions", headers, body)
end
"""


def body_for(n_msgs: int, stream: bool, unique: bool) -> str:
    """The request body; in unique mode the last user message holds MARK for wrk to fill."""
    last = f"And what is 21 times 2? (run {uuid.uuid4().hex[:8]}, request {MARK})"
    msgs = history(n_msgs, last) if unique else history(n_msgs)
    return json.dumps({"model": "m", "messages": msgs, "max_tokens": 64, "stream": stream})


def run_wrk(url: str, keys: list[str], body: str, conns: int, seconds: float) -> dict:
    """One wrk run; returns req/s and latency percentiles in ms."""
    head, _, tail = body.partition(MARK)
    lua = (LUA.replace("KEYS", ",".join(f'"{k}"' for k in keys))
           .replace("HEAD", head).replace("TAIL", tail)
           .replace("UNIQUE", "true" if MARK in body else "false"))
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(lua)
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency", "-s", f.name, url],
        capture_output=True, text=True)
    os.unlink(f.name)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed: {out.stderr}")
    text = out.stdout
    if re.search(r"Non-2xx or 3xx responses: (\d+)", text):
        raise RuntimeError(f"wrk saw errors:\n{text}")

    def pct(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
        assert m, text
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    assert rps, text
    return {"rps": float(rps.group(1)), "p50": pct("50"), "p99": pct("99")}


def engine_direct_p50(model_dir: str, n: int = 2000) -> float:
    """p50 ms of FakeEngine.generate called in-process on a rendered 2-message prompt."""
    from relayrl.chat.conversation import Conversation, Message
    from relayrl.chat.renderer import Renderer
    from relayrl.engine.fake import FakeEngine
    from relayrl.types import GenerateRequest, SamplingParams

    engine = FakeEngine([REPLY], tokenizer_path=model_dir)
    renderer = Renderer.from_pretrained(model_dir)
    conv = Conversation(tuple(Message(role=m["role"], content=m["content"]) for m in history(2)))
    ids = renderer.render(conv)
    params = SamplingParams(max_new_tokens=64, stop_token_ids=renderer.stop_token_ids)

    async def go() -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            await engine.generate(GenerateRequest(ids, params))
            times.append((time.perf_counter() - t) * 1e3)
        return times

    return statistics.median(asyncio.run(go()))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def start_gateway(model_dir: str, src: str | None = None) -> tuple[subprocess.Popen, str]:
    """A `--serve` child (relayrl from `src` when given); returns it and its URL."""
    port_file = tempfile.mktemp()
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen([sys.executable, __file__, "--serve", model_dir, port_file], env=env)
    for _ in range(600):
        if os.path.exists(port_file) and Path(port_file).read_text():
            return proc, Path(port_file).read_text()
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the gateway child did not start")


def session_keys(url: str) -> list[str]:
    """Open SESSIONS sessions; their keys."""
    admin = {"authorization": f"Bearer {ADMIN}"}
    return [httpx.post(url + "/rl/start_session", json={}, headers=admin).json()["api_key"]
            for _ in range(SESSIONS)]


def compare(model_dir: str, baseline_src: str, args: argparse.Namespace) -> None:
    """Every row on this tree's gateway and the baseline's, interleaved; a table of both."""
    procs = []
    try:
        (p_new, new), (p_old, old) = start_gateway(model_dir), start_gateway(model_dir,
                                                                              baseline_src)
        procs = [p_new, p_old]
        keys = {new: session_keys(new), old: session_keys(old)}
        print("| history | mode | stream | conc. | req/s | p50 ms | baseline req/s | "
              "baseline p50 ms | p50 baseline / this (per round) |")
        print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
        for n_msgs in _ints(args.histories):
            for mode in [m for m in args.modes.split(",") if m]:
                for stream in [x == "yes" for x in args.stream.split(",") if x]:
                    for conns in _ints(args.conns):
                        got: dict[str, list[dict]] = {new: [], old: []}
                        for r in range(args.rounds):
                            order = (new, old) if r % 2 == 0 else (old, new)
                            for url in order:
                                body = body_for(n_msgs, stream, mode == "unique")
                                run_wrk(url, keys[url], body, conns, 1.0)  # warm-up
                                got[url].append(run_wrk(url, keys[url], body, conns,
                                                        args.seconds))
                        med = {u: {k: statistics.median(x[k] for x in v) for k in ("rps", "p50")}
                               for u, v in got.items()}
                        ratios = ", ".join(f"{o['p50'] / n['p50']:.2f}"
                                           for n, o in zip(got[new], got[old], strict=True))
                        print(f"| {n_msgs} | {mode} | {'yes' if stream else 'no'} | {conns} | "
                              f"{med[new]['rps']:.0f} | {med[new]['p50']:.2f} | "
                              f"{med[old]['rps']:.0f} | {med[old]['p50']:.2f} | {ratios} |",
                              flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def main() -> None:
    """Run the matrix and print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--histories", default="2,22,102", help="history lengths, comma-separated")
    ap.add_argument("--conns", default="1,8,32", help="wrk connections, comma-separated")
    ap.add_argument("--modes", default="repeated,unique", help="history modes: repeated,unique")
    ap.add_argument("--stream", default="no,yes", help="streaming: no,yes")
    ap.add_argument("--serve", nargs=2, metavar=("MODEL_DIR", "PORT_FILE"))
    ap.add_argument("--baseline-src", help="another checkout's src/: run every row on both")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (with a baseline)")
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    if shutil.which("wrk") is None:
        sys.exit("needs wrk: apt-get install wrk")
    from relayrl.models import model_path

    model_dir = model_path("smollm2-135m-instruct")
    if args.baseline_src:
        print(f"load average at the start: {os.getloadavg()}")
        compare(str(model_dir), args.baseline_src, args)
        print(f"load average at the end: {os.getloadavg()}")
        return
    port_file = tempfile.mktemp()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", model_dir, port_file])
    modes = [m for m in args.modes.split(",") if m]
    streams = [s == "yes" for s in args.stream.split(",") if s]
    try:
        for _ in range(300):
            if os.path.exists(port_file) and Path(port_file).read_text():
                break
            time.sleep(0.1)
        url = Path(port_file).read_text()
        admin = {"authorization": f"Bearer {ADMIN}"}
        keys = [httpx.post(url + "/rl/start_session", json={}, headers=admin).json()["api_key"]
                for _ in range(SESSIONS)]
        rows = []
        for n_msgs in _ints(args.histories):
            for mode in modes:
                for stream in streams:
                    body = body_for(n_msgs, stream, mode == "unique")
                    run_wrk(url, keys, body, 8, 1.0)  # warm-up
                    for conns in _ints(args.conns):
                        r = run_wrk(url, keys, body_for(n_msgs, stream, mode == "unique"),
                                    conns, args.seconds)
                        rows.append((n_msgs, mode, stream, conns, r))
                        print(f"{n_msgs:>4} msgs {mode:8} stream={stream!s:5} c={conns:>2}: "
                              f"{r['rps']:8.0f} req/s p50 {r['p50']:.2f} ms "
                              f"p99 {r['p99']:.2f} ms", flush=True)
        direct = engine_direct_p50(model_dir)
    finally:
        proc.terminate()
        proc.wait(10)
    report(rows, direct)


def report(rows: list[tuple[int, str, bool, int, dict]], direct: float) -> None:
    """Print the markdown table and the comparisons with AReaL's numbers."""
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    print(f"\nuvicorn HTTP parser: {http}; event loop: {loop}")
    print("\n| history | mode | stream | concurrency | req/s | p50 ms | p99 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n_msgs, mode, stream, conns, r in rows:
        print(f"| {n_msgs} | {mode} | {'yes' if stream else 'no'} | {conns} | {r['rps']:.0f} | "
              f"{r['p50']:.2f} | {r['p99']:.2f} |")
    cell = {(n, m, s, c): r for n, m, s, c, r in rows}
    print(f"\nFakeEngine.generate in-process p50: {direct:.3f} ms")
    for mode in dict.fromkeys(m for _, m, *_ in rows):
        two, long = cell.get((2, mode, False, 1)), cell.get((102, mode, False, 1))
        if two:
            print(f"[{mode}] gateway p50 at c=1, 2 msgs: {two['p50']:.2f} ms -> overhead "
                  f"{two['p50'] - direct:.2f} ms; {AREAL_P50_C1 / two['p50']:.1f}x lower than "
                  f"AReaL's {AREAL_P50_C1} ms")
        if two and long:
            print(f"[{mode}] p50 ratio 102 msgs / 2 msgs at c=1: {long['p50'] / two['p50']:.2f}")
        if long:
            print(f"[{mode}] p50 at 102 msgs, c=1: {long['p50']:.2f} ms; "
                  f"{AREAL_P50_102 / long['p50']:.1f}x lower than AReaL's {AREAL_P50_102} ms")
        for stream in (False, True):
            got = [r["rps"] for n, m, s, _, r in rows if m == mode and s == stream]
            if got:
                print(f"[{mode}] best req/s, stream={stream}: {max(got):.0f} "
                      f"({max(got) / AREAL_RPS:.1f}x AReaL's {AREAL_RPS:.0f} req/s)")


if __name__ == "__main__":
    main()
