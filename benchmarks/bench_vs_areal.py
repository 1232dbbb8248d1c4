"""relayrl's gateway and AReaL's OpenAI proxy, side by side, driven by the same aiohttp client.

Run by hand, under the shared benchmark lock (AReaL's venv from `scripts/install_areal.sh`):

    flock /tmp/relayrl-bench.lock python -m benchmarks vs-areal [--rounds 4] [--requests 400]

Two servers, each in its own process on loopback, both answering every call with the same
29-token reply ("The result is 42. " * 4, then the end-of-sequence token) and recording it in a
session:
  - relayrl: `GatewayThread` over `FakeEngine`;
  - AReaL 1.0.4: `areal.experimental.openai.proxy.proxy_rollout_server`, the server AReaL's
    agents point `base_url` at (its `app`, served by uvicorn with the settings of its `main()`),
    with `ArealOpenAI` over a mock engine whose `agenerate` answers the same reply ids, and the
    same tokenizer (the default model's directory). It runs in AReaL's own venv
    (`RELAYRL_AREAL_VENV`, default `.venv-areal` beside this checkout or its main worktree);
    without one, only relayrl is measured.

Every row is measured on both, interleaved (A then B, then B then A, `--rounds` times), each after
a warm-up; the table shows medians over rounds and the median of the per-round req/s ratios.
Sessions are opened before a measurement and ended after it (not timed), `--per-session`
calls each, because AReaL's proxy links a call to its parent by scanning the session's earlier
calls: an agent session holds a handful of calls, not thousands. The episode row times a whole
episode: start a session, 5 calls with a growing history (each reply's role and content sent
back, then a new user turn), end it; AReaL's per-session capacity is granted beforehand. The
last row runs 51-call episodes the same way (the history grows from 2 to 102 messages), reports
calls/s and the p50 of the calls at 102 messages, and under it the ratio of that p50 to the p50
of the same episodes' first calls (2 messages): how a call's latency grows with its history in
an agent loop, where each call continues the one before.

`--smoke` runs four rows at tiny counts, one round; without AReaL's venv it pairs relayrl with the
do-nothing server (the `--ceiling` arm) so that both child servers and the client run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import harness

NAME = "vs-areal"
ADMIN = "bench-admin-key-0123456789abcdef"
REPLY = "The result is 42. " * 4
"""What both engines answer."""
HERE = Path(__file__).resolve().parent


def history(n_messages: int, last: str = "And what is 21 times 2?") -> list[dict[str, str]]:
    """A tool-free chat of n messages ending with the user turn `last`."""
    msgs = [{"role": "system", "content": "You are a careful assistant that answers briefly."}]
    turn = 0
    while len(msgs) < n_messages - 1:
        msgs.append({"role": "user", "content": f"Question {turn}: what is {turn} plus {turn}?"})
        msgs.append({"role": "assistant", "content": f"{turn} plus {turn} is {2 * turn}."})
        turn += 1
    msgs.append({"role": "user", "content": last})
    return msgs[:n_messages]


# --------------------------------------------------------------------------------------------
# servers (child processes)


def serve_relayrl(model_dir: str, port_file: str) -> None:
    """Child process: relayrl's gateway over a FakeEngine answering REPLY."""
    from relayrl.engine.fake import FakeEngine
    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.server import GatewayThread, build_deps

    engine = FakeEngine([REPLY], tokenizer_path=model_dir)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN, max_sessions=100_000,
                        session_ttl_s=3600)
    gw = GatewayThread(build_deps(cfg, engine=engine)).start()
    Path(port_file).write_text(gw.url)
    try:
        while True:
            time.sleep(1)
    finally:
        gw.stop()


def serve_areal(model_dir: str, port_file: str) -> None:
    """Child process (AReaL's venv): AReaL's proxy rollout server over a mock engine."""
    import socket

    import uvicorn
    from areal.api import ModelRequest, ModelResponse
    from areal.experimental.openai import ArealOpenAI
    from areal.experimental.openai.proxy import proxy_rollout_server as proxy
    from areal.utils.hf_utils import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(model_dir)
    reply_ids = [*tokenizer.encode(REPLY, add_special_tokens=False), tokenizer.eos_token_id]

    class MockEngine:
        """Answers every request with REPLY, as relayrl's FakeEngine does."""

        async def agenerate(self, req: ModelRequest) -> ModelResponse:
            n = len(reply_ids)
            return ModelResponse(input_tokens=list(req.input_ids), output_tokens=list(reply_ids),
                                 output_logprobs=[-0.5] * n, output_versions=[0] * n,
                                 stop_reason="stop", tokenizer=req.tokenizer)

    # What `/create_engine` + `/call initialize` set up (`_setup_openai_client`), with AgentConfig's
    # defaults (tool_call_parser "qwen", reasoning_parser "qwen3", chat_template_type "hf").
    proxy._engine = MockEngine()  # type: ignore[assignment]
    proxy._openai_client = ArealOpenAI(engine=proxy._engine, tokenizer=tokenizer)
    proxy._admin_api_key = ADMIN
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    proxy._server_host, proxy._server_port = sock.getsockname()
    Path(port_file).write_text(f"http://127.0.0.1:{proxy._server_port}")
    # the settings of proxy_rollout_server.main()
    config = uvicorn.Config(proxy.app, log_level="warning", timeout_keep_alive=300,
                            access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def serve_null(port_file: str) -> None:
    """Child process (`--ceiling`): a server that does nothing but answer.

    It reads each request whole and answers it with fixed bytes shaped like relayrl's answers
    (a completion of REPLY; streamed, one event per token as relayrl sends them, then [DONE]),
    parsing nothing and recording nothing, on the loop and HTTP parser relayrl serves with.
    What this client measures against it is the most any server could do on this machine: the
    rest of a call's time is the client's and the loopback's.
    """
    import socket

    import uvicorn

    from relayrl.asgi import uvicorn_options

    completion = json.dumps({
        "id": "chatcmpl-null", "object": "chat.completion", "created": 0, "model": "policy",
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": REPLY}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 29, "total_tokens": 69}}).encode()
    events = [b"data: " + json.dumps({
        "id": "chatcmpl-null", "object": "chat.completion.chunk", "created": 0, "model": "policy",
        "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}).encode()
        + b"\n\n" for piece in [w + " " for w in REPLY.split()] + ["", "", ""]]
    events.append(b"data: [DONE]\n\n")
    session = b'{"api_key": "null-session-key-0123456789"}'
    json_headers = [(b"content-type", b"application/json")]

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"].endswith("/chat/completions") and b'"stream": true' in raw:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        answer = completion if scope["path"].endswith("/chat/completions") else (
            session if scope["path"].endswith("/start_session") else b"{}")
        await send({"type": "http.response.start", "status": 200, "headers": json_headers})
        await send({"type": "http.response.body", "body": answer})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    Path(port_file).write_text(f"http://127.0.0.1:{sock.getsockname()[1]}")
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=300,
                            **uvicorn_options())
    uvicorn.Server(config).run(sockets=[sock])


def start(cmd: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start a server child that writes its URL to the port file given as its last argument."""
    port_file = tempfile.mktemp()
    proc = subprocess.Popen([*cmd, port_file], env=harness.child_env() if env is None else env)
    for _ in range(1800):
        if os.path.exists(port_file) and Path(port_file).read_text():
            url = Path(port_file).read_text()
            os.unlink(port_file)
            return proc, url
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start: {cmd}")


def areal_venv() -> Path | None:
    """AReaL's venv: $RELAYRL_AREAL_VENV, else .venv-areal in this checkout or its main worktree."""
    if os.environ.get("RELAYRL_AREAL_VENV"):
        cands = [Path(os.environ["RELAYRL_AREAL_VENV"])]
    else:
        cands = [HERE.parent / ".venv-areal"]
        try:  # a worktree shares its main checkout's ignored venv
            common = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--git-common-dir"],
                                    capture_output=True, text=True, check=True).stdout.strip()
            cands.append((HERE / common).resolve().parent / ".venv-areal")
        except (OSError, subprocess.CalledProcessError):
            pass
    for c in cands:
        if (c / "bin" / "python").exists():
            return c
    return None


# --------------------------------------------------------------------------------------------
# the client


@dataclass
class Server:
    """One server under test and how its protocol differs."""

    name: str
    url: str
    chat_path: str
    grant_capacity: bool  # AReaL: every session needs a capacity grant first
    sessions: list[str] = field(default_factory=list)
    pid: int = 0
    """The server's process, whose CPU time `--cpu` reads (0: not read)."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (Linux /proc; 0.0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def body(messages: list[dict[str, str]], stream: bool = False) -> bytes:
    """A Chat Completions body; temperature and top_p sent so AReaL does not warn per call."""
    return json.dumps({"model": "policy", "messages": messages, "max_tokens": 64,
                       "temperature": 1.0, "top_p": 1.0, "stream": stream}).encode()


def auth(key: str) -> dict[str, str]:
    """Headers of a JSON call with `key`."""
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


async def post(http: Any, url: str, key: str, data: bytes) -> bytes:
    """POST and read the whole answer (a stream to its end); any non-200 is an error."""
    async with http.post(url, data=data, headers=auth(key)) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {raw[:300]!r}")
        return raw


async def open_session(http: Any, srv: Server) -> str:
    """Start a session; its key."""
    if srv.grant_capacity:
        await post(http, f"{srv.url}/grant_capacity", ADMIN, b"{}")
    payload = {"task_id": uuid.uuid4().hex[:12]}
    raw = await post(http, f"{srv.url}/rl/start_session", ADMIN, json.dumps(payload).encode())
    return json.loads(raw)["api_key"]


async def end_session(http: Any, srv: Server, key: str) -> None:
    """End a session."""
    await post(http, f"{srv.url}/rl/end_session", key, b"{}")


@dataclass
class Row:
    """One row of the table: a workload at a concurrency."""

    name: str
    conc: int
    kind: str  # "chat" or "episode"
    messages: int = 2
    stream: bool = False
    unique: bool = False


ROWS = [
    Row("chat, 2 messages, c=1", 1, "chat"),
    Row("chat, 2 messages, c=8", 8, "chat"),
    Row("chat streamed, 2 messages, c=8", 8, "chat", stream=True),
    Row("5-turn episode (start, 5 calls, end), c=1", 1, "episode"),
    Row("102 messages, repeated history, c=1", 1, "chat", messages=102),
    Row("102 messages, unique histories, c=1", 1, "chat", messages=102, unique=True),
    Row("agent episode's call at 102 messages (51 calls, history grows), c=1", 1, "grow",
        messages=102),
    Row("2 messages, unique histories, c=1", 1, "chat", unique=True),
]
GROW_CALLS = 51
"""Calls in a "grow" row's episode: the history goes from 2 to 102 messages, replies sent back."""


async def measure(http: Any, srv: Server, row: Row, n: int, per_session: int) -> dict[str, float]:
    """Run `n` units of `row` (calls, or episodes) against `srv`; units/s and p50 ms of one unit."""
    keys: list[str] = []
    if row.kind == "chat":
        keys = [await open_session(http, srv) for _ in range(max(1, -(-n // per_session)))]
    elif srv.grant_capacity:
        for _ in range(n):
            await post(http, f"{srv.url}/grant_capacity", ADMIN, b"{}")
    run_id = uuid.uuid4().hex[:8]
    url = srv.url + srv.chat_path
    fixed = body(history(row.messages), row.stream)
    # unique bodies are made before the clock starts: a call's time is the server's round trip,
    # not the client's json.dumps of a 102-message history
    unique = [body(history(row.messages, f"And what is 21 times 2? ({run_id}-{i})"), row.stream)
              for i in range(n)] if row.unique else []

    async def chat(i: int) -> None:
        data = unique[i] if row.unique else fixed
        raw = await post(http, url, keys[i % len(keys)], data)
        if row.stream and not raw.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"{srv.name}: stream did not end with [DONE]: {raw[-200:]!r}")

    async def episode(i: int) -> None:
        key = await open_session_no_grant(http, srv)
        msgs = history(2, f"Episode {run_id}-{i}: what is 21 times 2?")
        for turn in range(5):
            raw = await post(http, url, key, body(msgs))
            reply = json.loads(raw)["choices"][0]["message"]
            # what an SDK sends back (AReaL's proxy refuses its own reply's extra fields)
            msgs.append({"role": "assistant", "content": reply["content"]})
            msgs.append({"role": "user", "content": f"Now add {turn} to that."})
        await end_session(http, srv, key)

    by_length: dict[int, list[float]] = {}

    async def grow(i: int) -> None:
        key = await open_session_no_grant(http, srv)
        msgs = history(2, f"Episode {run_id}-{i}: what is 21 times 2?")
        for turn in range(GROW_CALLS):
            t = time.perf_counter()
            raw = await post(http, url, key, body(msgs))
            by_length.setdefault(len(msgs), []).append(time.perf_counter() - t)
            msgs.append({"role": "assistant",
                         "content": json.loads(raw)["choices"][0]["message"]["content"]})
            msgs.append({"role": "user", "content": f"Now add {turn} to that."})
        await end_session(http, srv, key)

    if row.kind == "grow":
        n = max(1, n // 6)  # episodes of 51 calls: a tenth of the chat rows' calls, or so
        if srv.grant_capacity:
            for _ in range(n):
                await post(http, f"{srv.url}/grant_capacity", ADMIN, b"{}")
    unit: Callable[[int], Awaitable[None]] = {"chat": chat, "episode": episode, "grow": grow}[row.kind]
    times: list[float] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            t = time.perf_counter()
            await unit(i)
            times.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(row.conc)))
    wall = time.perf_counter() - t0
    for k in keys:
        await end_session(http, srv, k)
    if row.kind == "grow":  # calls/s; p50 of the calls at `row.messages`, and of the first calls
        return {"rps": n * GROW_CALLS / wall, "p50": statistics.median(by_length[row.messages]) * 1e3,
                "p50_first": statistics.median(by_length[2]) * 1e3, "units": n * GROW_CALLS}
    return {"rps": n / wall, "p50": statistics.median(times) * 1e3, "units": n}


async def open_session_no_grant(http: Any, srv: Server) -> str:
    """Start a session whose capacity (AReaL) was granted beforehand; its key."""
    payload = {"task_id": uuid.uuid4().hex[:12]}
    raw = await post(http, f"{srv.url}/rl/start_session", ADMIN, json.dumps(payload).encode())
    return json.loads(raw)["api_key"]


async def run_all(servers: list[Server], rows: list[Row], args: argparse.Namespace,
                  say: Callable[[str], None] = print) -> None:
    """Every row on every server, interleaved; says the markdown table row by row."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=64, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as http:
        names = [s.name for s in servers]
        pair = len(servers) >= 2
        ceiling = len(servers) == 3
        head = "| row | " + " | ".join(f"{n} /s | {n} p50 ms" for n in names)
        head += " | req/s ratio (per round) | p50 ratio |" if pair else " |"
        head += " ceiling: null/AReaL req/s | relayrl/null req/s |" if ceiling else ""
        cpu = getattr(args, "cpu", False)
        head += (" CPU µs a call or episode: " + " / ".join(names) + "; client against each |"
                 if cpu else "")
        say(head)
        say("|" + " --- |" * (1 + 2 * len(servers) + 2 * pair + 2 * ceiling + cpu))
        for row in rows:
            n = args.episodes if row.kind == "episode" else args.requests
            got: dict[str, list[dict[str, float]]] = {s.name: [] for s in servers}
            for s in servers:  # warm-up: caches, connections, the allocator
                await measure(http, s, row, max(row.conc, n // 5), args.per_session)
            for _, s in harness.rounds(servers, args.rounds):  # A B C, then C B A
                before, client = cpu_seconds(s.pid) if s.pid else 0.0, time.process_time()
                m = await measure(http, s, row, n, args.per_session)
                # CPU time is what a loaded machine does not inflate much: each process's work
                # per call (or episode), sessions opened and ended around it included
                m["cpu_us"] = ((cpu_seconds(s.pid) - before) if s.pid else 0.0) / m["units"] * 1e6
                m["client_us"] = (time.process_time() - client) / m["units"] * 1e6
                got[s.name].append(m)
            cells = []
            for s in servers:
                med = {k: statistics.median(x[k] for x in got[s.name]) for k in ("rps", "p50")}
                cells += [f"{med['rps']:.0f}", f"{med['p50']:.2f}"]
            line = f"| {row.name} | " + " | ".join(cells)
            if pair:
                a, b = got[servers[0].name], got[servers[1].name]
                per = harness.per_round_ratios([x["rps"] for x in a], [y["rps"] for y in b])
                p50 = statistics.median(y["p50"] / x["p50"] for x, y in zip(a, b, strict=True))
                line += (f" | **{statistics.median(per):.1f}×** "
                         f"({', '.join(f'{p:.1f}' for p in per)}) | {p50:.1f}× |")
            if ceiling:
                c = got[servers[2].name]
                top = statistics.median(z["rps"] / y["rps"] for y, z in zip(b, c, strict=True))
                share = statistics.median(x["rps"] / z["rps"] for x, z in zip(a, c, strict=True))
                line += f" {top:.1f}× | {share:.0%} |"
            if cpu:
                med_cpu = [statistics.median(x["cpu_us"] for x in got[s.name]) for s in servers]
                med_cli = [statistics.median(x["client_us"] for x in got[s.name]) for s in servers]
                line += (f" {' / '.join(f'{c:.0f}' for c in med_cpu)}; client "
                         f"{' / '.join(f'{c:.0f}' for c in med_cli)} |")
            say(line + ("" if pair else " |"))
            if row.kind == "grow":  # the same episodes' first calls: how latency grows with history
                for s in servers:
                    per = [x["p50"] / x["p50_first"] for x in got[s.name]]
                    say(f"|   {s.name}: p50 at {row.messages} messages / p50 at 2 messages, same "
                          f"episodes: **{statistics.median(per):.2f}** "
                          f"({', '.join(f'{p:.2f}' for p in per)}); p50 at 2 messages "
                        f"{statistics.median(x['p50_first'] for x in got[s.name]):.2f} ms |")


def main(argv: list[str] | None = None) -> None:
    """Start the servers, run the rows, print the table."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds per row")
    ap.add_argument("--requests", type=int, default=400, help="calls per measurement")
    ap.add_argument("--episodes", type=int, default=60, help="episodes per measurement")
    ap.add_argument("--per-session", type=int, default=8, help="calls per session (chat rows)")
    ap.add_argument("--rows", default="", help="row numbers to run, comma-separated (1-based)")
    ap.add_argument("--relayrl-only", action="store_true", help="do not start AReaL")
    ap.add_argument("--serve-relayrl", nargs=2, metavar=("MODEL_DIR", "PORT_FILE"))
    ap.add_argument("--serve-areal", nargs=2, metavar=("MODEL_DIR", "PORT_FILE"))
    ap.add_argument("--ceiling", action="store_true",
                    help="also measure a server that only answers (needs AReaL's venv)")
    ap.add_argument("--serve-null", metavar="PORT_FILE")
    ap.add_argument("--cpu", action="store_true",
                    help="also show each server's and the client's CPU time per call (Linux)")
    args = ap.parse_args(argv)
    if args.serve_null:
        serve_null(args.serve_null)
        return
    if args.serve_relayrl:
        serve_relayrl(*args.serve_relayrl)
        return
    if args.serve_areal:
        serve_areal(*args.serve_areal)
        return
    if args.smoke:
        args.rows, args.requests, args.episodes, args.rounds, args.per_session = (
            "1,3,4,7", 12, 2, 1, 4)
    run = harness.Run.start(NAME, args, argv)

    from relayrl.models import model_path

    model_dir = str(model_path("smollm2-135m-instruct"))
    venv = None if args.relayrl_only else areal_venv()
    if venv is None and not args.relayrl_only:
        print("AReaL's venv is missing (make it with scripts/install_areal.sh, or point "
              "RELAYRL_AREAL_VENV at one): measuring relayrl alone"
              + (" and, as a smoke run, the do-nothing server" if args.smoke else ""), flush=True)
    rows = ROWS if not args.rows else [ROWS[int(i) - 1] for i in args.rows.split(",")]
    procs: list[subprocess.Popen] = []
    try:
        p, url = start(harness.child_command(NAME, "--serve-relayrl", model_dir))
        procs.append(p)
        servers = [Server("relayrl", url, "/v1/chat/completions", grant_capacity=False,
                          pid=p.pid)]
        if venv is not None:
            env = {**os.environ, "AREAL_PROXY_WARN_ONCE": "1", "PYTHONPATH": str(harness.ROOT),
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
            p, url = start(harness.child_command(NAME, "--serve-areal", model_dir,
                                                 python=str(venv / "bin" / "python")), env=env)
            procs.append(p)
            servers.append(Server("AReaL", url, "/chat/completions", grant_capacity=True,
                                  pid=p.pid))
        if (venv is not None and args.ceiling) or (venv is None and args.smoke):
            p, url = start(harness.child_command(NAME, "--serve-null"))
            procs.append(p)
            servers.append(Server("null", url, "/v1/chat/completions", grant_capacity=False,
                                  pid=p.pid))
        run.say(f"date {harness.utc_now()}; load average at the start {run.load_before:.2f}")
        _run(run_all(servers, rows, args, run.say))
        run.say(f"load average at the end {harness.load_average():.2f}")
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    run.finish()


def _run(main: Awaitable[None]) -> None:
    # the client runs on uvloop when it is there: the same client for both servers, and the
    # less it costs the less it hides of the faster server's time
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)  # type: ignore[arg-type]
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
