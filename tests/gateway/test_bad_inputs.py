"""Hand-made bad inputs against a real uvicorn gateway on loopback (issue 10, items 8, 9 and 12).

Every bad request to the three wire APIs must be a 4xx in that protocol's own error shape (OpenAI
for /v1/chat/completions and /v1/responses, Anthropic for /v1/messages), never a 500, and must
leave the session's export unchanged. Crafted inputs that used to crash (deep nesting, lone
surrogates) or exhaust the server (huge chunked bodies, huge prompts, half-sent requests) are
checked one by one. The FakeEngine keeps these fast; the context-length check also runs against
the real model.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from typing import Any

import httpx
import pytest

from relayrl.engine.fake import FakeEngine
from relayrl.errors import InvalidRequest
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from tests.gateway.conftest import Gateway, Script, fake_gateway

CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
WIRES = (CHAT, RESPONSES, MESSAGES)
DEEP = 100_000
"""Nesting depth that makes a recursive JSON parser (or anything after it) overflow."""


@pytest.fixture
def lgw(model_dir: str, tmp_path) -> Iterator[Gateway]:
    """A fake-engine gateway with a durable log (so journal writes are exercised)."""
    g = fake_gateway(model_dir, tmp_log=str(tmp_path / "calls.sqlite"))
    yield g
    g.thread.stop()


def good_body(route: str, text: str = "hi", **extra: Any) -> dict[str, Any]:
    """A minimal valid request for `route`."""
    if route == CHAT:
        return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}
    if route == RESPONSES:
        return {"model": "m", "input": [{"role": "user", "content": text}], **extra}
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": text}],
            **extra}


def token_field(route: str) -> str:
    return {CHAT: "max_tokens", RESPONSES: "max_output_tokens", MESSAGES: "max_tokens"}[route]


def with_messages(route: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = good_body(route)
    body["input" if route == RESPONSES else "messages"] = messages
    return body


def tool_without_id(route: str) -> dict[str, Any]:
    if route == CHAT:
        return with_messages(route, [{"role": "user", "content": "hi"},
                                     {"role": "tool", "content": "5"}])
    if route == RESPONSES:
        return with_messages(route, [{"role": "user", "content": "hi"},
                                     {"type": "function_call_output", "output": "5"}])
    return with_messages(route, [{"role": "user", "content": [
        {"type": "tool_result", "content": "5"}]}])


def surrogate_in_tool_arguments(route: str) -> str:
    """A body whose tool-call arguments hold a lone surrogate (as JSON text: json.dumps escapes)."""
    if route == CHAT:
        msgs = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": '{"a": "\ud800"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    elif route == RESPONSES:
        msgs = [{"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "f",
                 "arguments": '{"a": "\ud800"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    else:
        msgs = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f",
                                                   "input": {"a": "\ud800"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                              "content": "ok"}]}]
    return json.dumps(with_messages(route, msgs))


def bad_cases(route: str) -> dict[str, tuple[bytes, dict[str, str]]]:
    """name -> (raw body, extra headers): each must be refused with a 4xx."""
    js = {"content-type": "application/json"}

    def enc(body: Any) -> bytes:
        return json.dumps(body).encode()

    tf = token_field(route)
    deep = b'{"model": "m", "metadata": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    return {
        "malformed json": (b'{"model": "m", "messages": [', js),
        "form-encoded body": (b"model=m&messages=hi",
                              {"content-type": "application/x-www-form-urlencoded"}),
        "not an object": (b"[1, 2, 3]", js),
        "deep nesting": (deep, js),
        "invalid utf-8": (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
                          js),
        "lone surrogate in content": (enc(good_body(route, "a \ud800 b")), js),
        "lone surrogate in tool arguments": (surrogate_in_tool_arguments(route).encode(), js),
        "empty messages": (enc(with_messages(route, [])), js),
        "unknown role": (enc(with_messages(route, [{"role": "wizard", "content": "hi"}])), js),
        "tool message without id": (enc(tool_without_id(route)), js),
        "max tokens zero": (enc({**good_body(route), tf: 0}), js),
        "max tokens negative": (enc({**good_body(route), tf: -5}), js),
        "max tokens huge": (enc({**good_body(route), tf: 10**12}), js),
        "max tokens a string": (enc({**good_body(route), tf: "10"}), js),
        "max tokens a bool": (enc({**good_body(route), tf: True}), js),
        "negative temperature": (enc({**good_body(route), "temperature": -0.5}), js),
        # Python's json writes and reads these; JSON has no such numbers
        "NaN in metadata": (enc({**good_body(route), "metadata": {"x": float("nan")}}), js),
        "Infinity as temperature": (enc({**good_body(route), "temperature": float("inf")}), js),
    }


def assert_protocol_error(route: str, r: httpx.Response) -> None:
    """A 4xx whose body is the route's own error shape."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    body = r.json()
    if route == MESSAGES:
        assert body["type"] == "error", body
        assert isinstance(body["error"]["type"], str) and body["error"]["message"], body
    else:
        err = body["error"]
        assert set(err) >= {"message", "type", "param", "code"}, body
        assert err["message"], body


def session_client(gw: Gateway, session: dict) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=30,
                        headers={"authorization": f"Bearer {session['api_key']}"})


def log_rows(gw: Gateway) -> int:
    assert gw.deps.log is not None
    return len(gw.deps.log)


@pytest.mark.parametrize("route", WIRES)
def test_bad_inputs_are_4xx_in_the_protocols_shape_and_record_nothing(lgw: Gateway,
                                                                      route: str) -> None:
    s = lgw.start_session(task_id="t")
    before_rows, before_log = lgw.export(s["session_id"]), log_rows(lgw)
    with session_client(lgw, s) as c:
        for name, (raw, headers) in bad_cases(route).items():
            r = c.post(route, content=raw, headers=headers)
            assert_protocol_error(route, r)
            assert name and not lgw.script.requests, f"{name}: reached the engine"
        # the same session still works afterwards: nothing was left half-way
        ok = c.post(route, json=good_body(route))
        assert ok.status_code == 200, ok.text
    assert before_rows == []
    assert len(lgw.export(s["session_id"])) == 1
    assert log_rows(lgw) == before_log + 1  # exactly the one good call was journaled


@pytest.mark.parametrize("route", WIRES)
def test_a_50_mb_body_is_a_413_in_the_protocols_shape(gw: Gateway, route: str) -> None:
    s = gw.start_session()
    raw = json.dumps(good_body(route, "x" * (50 << 20))).encode()
    with session_client(gw, s) as c:
        assert_protocol_error(route, r := c.post(route, content=raw,
                                                 headers={"content-type": "application/json"}))
        assert r.status_code == 413
    assert gw.export(s["session_id"]) == []


def raw_request(url: str, head: bytes, timeout_s: float = 10.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.sendall(head)
    return sock


def read_response(sock: socket.socket, limit_s: float) -> bytes:
    """What the server sends until it closes or `limit_s` passes (bounded)."""
    sock.settimeout(0.2)
    got = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            part = sock.recv(65536)
        except TimeoutError:
            if b"\r\n\r\n" in got and b'"}' in got:
                break
            continue
        except ConnectionResetError:
            break
        if not part:
            break
        got += part
    return got


def test_a_huge_chunked_body_is_refused_before_it_is_read_whole(gw: Gateway) -> None:
    s = gw.start_session()
    head = (f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {s['api_key']}\r\ntransfer-encoding: chunked\r\n\r\n").encode()
    sock = raw_request(gw.url, head)
    chunk = b"x" * (1 << 20)
    sent = 0
    try:
        # 12 MiB against the 8 MiB limit, then stop without the final chunk: a server that
        # buffers the whole body before checking would wait for the rest forever
        for _ in range(12):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused while we were still sending: what we want
    reply = read_response(sock, limit_s=10)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"error"' in reply


def test_deep_nesting_without_a_key_is_a_4xx_not_a_500(gw: Gateway) -> None:
    deep = b'{"model": "m", "messages": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    for route in WIRES:
        r = httpx.post(gw.url + route, content=deep, headers={"content-type": "application/json"})
        assert_protocol_error(route, r)


def test_a_500_keeps_the_keep_alive_connection(model_dir: str) -> None:
    def explode(request):
        raise RuntimeError("engine bug")

    engine = FakeEngine(explode, tokenizer_path=model_dir)
    cfg = GatewayConfig(model=model_dir, engine="fake", model_label="relayrl-test")
    with GatewayThread(build_deps(cfg, engine=engine)) as thread:
        host, port = thread.url.removeprefix("http://").split(":")
        conn = HTTPConnection(host, int(port), timeout=30)
        body = json.dumps(good_body(CHAT))
        conn.request("POST", CHAT, body=body, headers={"content-type": "application/json"})
        r1 = conn.getresponse()
        first = json.loads(r1.read())
        assert r1.status == 500 and first["error"]["message"]
        assert r1.getheader("connection") != "close"
        sock = conn.sock
        assert sock is not None
        local = sock.getsockname()
        conn.request("GET", "/v1/models")
        r2 = conn.getresponse()
        assert r2.status == 200 and json.loads(r2.read())["data"]
        assert conn.sock is sock and sock.getsockname() == local  # the same connection
        conn.close()


def test_an_unexpected_error_on_an_rl_route_keeps_the_connection(
        gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.gateway import routes_rl

    async def boom(request, model):
        raise RuntimeError("a bug")

    monkeypatch.setattr(routes_rl, "read_model", boom)
    host, port = gw.url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/rl/start_session", body="{}",
                 headers={"content-type": "application/json",
                          "authorization": "Bearer admin-test-key"})
    r1 = conn.getresponse()
    assert r1.status == 500 and json.loads(r1.read())["error"]["message"]
    sock = conn.sock
    assert sock is not None
    conn.request("GET", "/v1/models")
    r2 = conn.getresponse()
    assert r2.status == 200 and json.loads(r2.read())["data"]
    assert conn.sock is sock  # the same connection
    conn.close()


def test_lone_surrogates_in_task_id_or_metadata_are_a_400(lgw: Gateway) -> None:
    before = log_rows(lgw)
    with lgw.admin() as c:
        for body in ({"task_id": "t\ud800"}, {"metadata": {"k": "\udfff"}},
                     {"metadata": {"\ud800": 1}}):
            r = c.post("/rl/start_session", content=json.dumps(body),
                       headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"]
        r = c.post("/rl/v1/start_session", content=json.dumps({"task_id": "\ud800x"}),
                   headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
    assert log_rows(lgw) == before
    # a valid surrogate pair (an emoji, escaped) is fine
    s = lgw.start_session(task_id="\U0001F600")
    assert lgw.export(s["session_id"]) == []


def test_a_locked_log_is_a_quick_503_and_does_not_stall_other_routes(lgw: Gateway) -> None:
    s = lgw.start_session()
    assert lgw.deps.log is not None
    locker = sqlite3.connect(str(lgw.deps.log.path), isolation_level=None, timeout=0)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        with session_client(lgw, s) as c:
            for route in WIRES:
                t0 = time.monotonic()
                r = c.post(route, json=good_body(route))
                took = time.monotonic() - t0
                assert r.status_code == 503, r.text
                assert_shape = r.json()
                if route == MESSAGES:
                    assert assert_shape["error"]["type"] == "overloaded_error"
                else:
                    assert assert_shape["error"]["message"]
                assert took < 3.0, f"the locked log held the call {took:.1f} s"
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert lgw.export(s["session_id"]) == []  # nothing recorded half-way
    with session_client(lgw, s) as c:
        assert c.post(CHAT, json=good_body(CHAT)).status_code == 200
    assert len(lgw.export(s["session_id"])) == 1


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(gw: Gateway) -> None:
    s = gw.start_session()
    text = "lorem ipsum dolor sit amet " * 280_000  # 7.2 MiB: minutes of tokenizing here
    with session_client(gw, s) as c:
        t0 = time.monotonic()
        r = c.post(CHAT, json=good_body(CHAT, text))
        took = time.monotonic() - t0
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert took < 5.0, f"{took:.1f} s: the prompt was tokenized before its size was checked"


def test_a_long_prompt_is_tokenized_off_the_event_loop(gw: Gateway) -> None:
    s = gw.start_session()
    words = ("alpha", "beta", "gamma", "été", "x1", "foo\n", "bar", "  ")
    text = " ".join(words[(i * 7) % len(words)] for i in range(120_000))  # ~0.6 M chars
    result: dict[str, Any] = {}

    def big() -> None:
        with session_client(gw, s) as c:
            t0 = time.monotonic()
            result["r"] = c.post(CHAT, json=good_body(CHAT, text))
            result["took"] = time.monotonic() - t0

    worker = threading.Thread(target=big)
    worker.start()
    lags = []
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        for _ in range(200):  # bounded: until the big call is answered
            if not worker.is_alive():
                break
            t0 = time.monotonic()
            assert c.get("/v1/models").status_code == 200
            lags.append(time.monotonic() - t0)
            time.sleep(0.05)
    worker.join(60)
    r = result["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert lags, "the big call was answered before anything else ran"
    assert max(lags) < max(1.0, result["took"] / 2), (max(lags), result["took"])


def test_a_long_prompt_tokenized_off_the_loop_is_exact_and_cached(gw: Gateway) -> None:
    from relayrl.chat.conversation import Conversation, Message
    from relayrl.gateway.core import OFFLOAD_CHARS

    text = "information " * 3000  # over OFFLOAD_CHARS, well under the context in tokens
    assert len(text) > OFFLOAD_CHARS
    s = gw.start_session()
    with session_client(gw, s) as c:
        for _ in range(2):  # a GRPO group's shared prompt: the second render is a cache hit
            r = c.post(CHAT, json=good_body(CHAT, text))
            assert r.status_code == 200, r.text
    first, second = (req.prompt_ids for req in gw.script.requests)
    expected = gw.deps.renderer.render(Conversation(messages=(Message("user", text),)))
    assert list(first) == list(second) == expected
    assert gw.deps.renders.hits >= 1


def slow_gateway(model_dir: str, **timeouts: float) -> GatewayThread:
    engine = FakeEngine(Script(), tokenizer_path=model_dir)
    cfg = GatewayConfig(model=model_dir, engine="fake", model_label="relayrl-test", **timeouts)
    return GatewayThread(build_deps(cfg, engine=engine)).start()


@pytest.mark.parametrize("partial", [
    b"",  # connected, sent nothing
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n",  # headers never finish
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
    b"\r\ncontent-length: 500\r\n\r\n{\"model\": ",  # body never finishes
])
def test_half_sent_requests_are_dropped_after_a_timeout(model_dir: str, partial: bytes) -> None:
    thread = slow_gateway(model_dir, header_timeout_s=0.5, body_timeout_s=0.5,
                          keep_alive_timeout_s=0.5)
    try:
        sock = raw_request(thread.url, partial)
        t0 = time.monotonic()
        got = read_response(sock, limit_s=8)
        took = time.monotonic() - t0
        sock.close()
        assert took < 5.0, "the server held a half-sent request"
        assert b"200 OK" not in got
    finally:
        thread.stop()


def test_idle_keep_alive_connections_are_closed(model_dir: str) -> None:
    thread = slow_gateway(model_dir, keep_alive_timeout_s=0.5)
    try:
        sock = raw_request(thread.url, b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        t0 = time.monotonic()
        got = read_response(sock, limit_s=8)
        sock.close()
        assert got.startswith(b"HTTP/1.1 200")
        assert time.monotonic() - t0 < 5.0
    finally:
        thread.stop()


# ------------------------------------------------------------------ item 12: wire details


def sse_events(r: httpx.Response) -> list[dict[str, Any]]:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def models_named(route: str, body: dict[str, Any]) -> set[str]:
    """Every `model` a reply names (top level, `response.model`, `message.model`)."""
    names = set()
    for obj in (body, body.get("response") or {}, body.get("message") or {}):
        if isinstance(obj, dict) and "model" in obj:
            names.add(obj["model"])
    return names


@pytest.mark.parametrize("route", WIRES)
def test_replies_name_the_policy_streamed_or_not(gw: Gateway, route: str) -> None:
    s = gw.start_session()
    with session_client(gw, s) as c:
        plain = c.post(route, json=good_body(route, model="gpt-4o-unknown"))
        streamed = c.post(route, json=good_body(route, model="gpt-4o-unknown", stream=True))
    assert plain.status_code == 200 and streamed.status_code == 200
    assert models_named(route, plain.json()) == {"relayrl-test"}
    named = set().union(*(models_named(route, e) for e in sse_events(streamed)))
    assert named == {"relayrl-test"}, named


def test_anthropic_takes_a_system_role_inside_messages_as_claude_code_sends_it(
        gw: Gateway) -> None:
    s = gw.start_session()
    body = with_messages(MESSAGES, [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hi"}])
    with session_client(gw, s) as c:
        r = c.post(MESSAGES, json=body)
    assert r.status_code == 200, r.text
    assert len(gw.export(s["session_id"])) == 1


def test_models_of_an_unknown_session_is_not_a_200(gw: Gateway) -> None:
    r = httpx.get(gw.url + "/s/no-such-session-key-0000/v1/models")
    assert r.status_code in (401, 404), r.text
    assert r.json()["error"]["message"]
    s = gw.start_session()
    ok = httpx.get(gw.url + f"/s/{s['api_key']}/v1/models")
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "relayrl-test"


# ------------------------------------------------------------------ the real model


@pytest.mark.slow
@pytest.mark.parametrize("route", WIRES)
def test_a_prompt_longer_than_the_real_context_is_a_400(real_gw: Gateway, route: str) -> None:
    s = real_gw.start_session()
    ctx = real_gw.deps.engine.context_length
    text = " ".join(f"w{i}" for i in range(ctx))  # more than one token per word: over the context
    with session_client(real_gw, s) as c:
        r = c.post(route, json=good_body(route, text))
    assert_protocol_error(route, r)
    assert r.status_code == 400
    if route != MESSAGES:
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert real_gw.export(s["session_id"]) == []


@pytest.mark.parametrize(("depth", "ok"), [(1, True), (63, True), (64, True), (65, False)])
def test_the_depth_limit_counts_every_level_exactly(depth: int, ok: bool) -> None:
    from relayrl.gateway.bodies import MAX_JSON_DEPTH, check_depth

    assert MAX_JSON_DEPTH == 64
    for opener, closer in ((b"[", b"]"), (b'{"a":', b"}")):
        value = json.loads(opener * depth + b"0" + closer * depth)
        if ok:
            check_depth(value)
        else:
            with pytest.raises(InvalidRequest, match="deeper than 64"):
                check_depth(value)
    check_depth([{"a": [1, {"b": "x"}]}, "s", 3])  # mixed lists and dicts, scalars anywhere
