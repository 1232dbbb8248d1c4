"""Issue 10 (items 2, 10, 11): a session is a secret, the control plane is closed, and the API
is published. Every test here failed before the fix it guards."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from relayrl.gateway.auth import MIN_KEY_CHARS
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps, ensure_admin_key
from tests.gateway.conftest import ADMIN, Gateway, fake_gateway

AUTH = {"authorization": f"Bearer {ADMIN}"}
MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": MSG}
ANTHROPIC = {"model": "m", "max_tokens": 8, "messages": MSG}


def start(gw: Gateway, path: str = "/rl/v1/start_session", **body) -> dict:
    r = httpx.post(gw.url + path, json=body, headers=AUTH)
    r.raise_for_status()
    return r.json()


def calls(gw: Gateway, session_id: str) -> int:
    return len(gw.deps.store.get(session_id, touch=False).interactions)


# ---- item 2: one 401 for every refused key, no oracle, nothing echoed --------------------------

def test_a_refused_session_key_gets_the_same_401_whether_the_session_is_live_ended_or_unknown(
        gw: Gateway) -> None:
    live, ended = start(gw), start(gw)
    httpx.post(gw.url + f"/s/{ended['api_key']}/rl/v1/finalize", json={}).raise_for_status()
    answers = {}
    for _state, target in (("live", live), ("ended", ended), ("unknown", None)):
        # a guessed key in the path, and the target's id where an id could be put
        guess = "g" * 43
        sid = target["session_id"] if target else "sess-" + "0" * 32
        for path, body in ((f"/s/{guess}/v1/chat/completions", CHAT),
                           (f"/s/{guess}/v1/messages", ANTHROPIC),
                           (f"/s/{guess}/rl/v1/set_reward", {"reward": 1.0}),
                           (f"/sessions/{sid}/v1/chat/completions", CHAT),
                           (f"/v1/chat/completions?session_id={sid}", CHAT)):
            r = httpx.post(gw.url + path, json=body)
            answers.setdefault(path.replace(sid, "ID"), set()).add(
                (r.status_code, r.text.replace(sid, "ID")))
    for path, seen in answers.items():
        assert len(seen) == 1, (path, seen)  # the same answer for live, ended and unknown
        ((status, text),) = seen
        assert status in (401, 404) and "g" * 43 not in text
        if "/s/" in path:
            assert status == 401
            if path.endswith("/messages"):
                assert '"type":"error"' in text.replace(" ", "")  # Anthropic's shape
            else:
                assert '"error":{' in text.replace(" ", "")      # OpenAI's shape
    assert calls(gw, live["session_id"]) == 0


def test_a_404_under_a_session_url_does_not_echo_the_key(gw: Gateway) -> None:
    s = start(gw)
    r = httpx.get(gw.url + f"/s/{s['api_key']}/v1/nope")
    assert r.status_code == 404 and s["api_key"] not in r.text and "/s/***/" in r.text


@pytest.mark.parametrize("path", ["/rl/start_session", "/rl/v1/start_session"])
def test_start_session_refuses_a_held_key_the_admin_key_and_short_keys(gw: Gateway,
                                                                       path: str) -> None:
    held = start(gw, api_key="k" * MIN_KEY_CHARS)
    for key in ("k" * MIN_KEY_CHARS, ADMIN, "x" * (MIN_KEY_CHARS - 1), "bad/key" * 4):
        r = httpx.post(gw.url + path, json={"api_key": key}, headers=AUTH)
        assert r.status_code == 400, key
        assert key not in r.text
    # the held key still reaches its own session, and only that one
    assert gw.deps.store.by_key("k" * MIN_KEY_CHARS).id == held["session_id"]


# ---- isolation: every route, with another session's key and with the admin key ----------------

SESSION_ROUTES = ["/rl/set_reward", "/rl/end_session", "/rl/v1/end_session", "/rl/v1/set_reward",
                  "/rl/v1/finalize", "/rl/v1/abort"]
ADMIN_ROUTES = ["/grant_capacity", "/rl/start_session", "/rl/v1/start_session",
                "/export_trajectories", "/rl/ack_export", "/rl/abort_session"]
WIRE = [("/v1/chat/completions", CHAT), ("/chat/completions", CHAT),
        ("/v1/responses", {"model": "m", "input": "hi"}), ("/responses", {"model": "m", "input": "hi"}),
        ("/v1/messages", ANTHROPIC)]


def test_every_route_refuses_the_wrong_kind_of_key(gw: Gateway) -> None:
    victim, other = start(gw), start(gw)
    OpenAI(base_url=victim["base_url"], api_key="x", max_retries=0).chat.completions.create(
        model="m", messages=MSG)
    ref = {"session_id": victim["session_id"], "reward": 1.0}
    other_h = {"authorization": f"Bearer {other['api_key']}"}
    for path in ADMIN_ROUTES:  # another session's key where the admin key belongs
        assert httpx.post(gw.url + path, json=ref, headers=other_h).status_code == 401, path
        assert httpx.get(gw.url + "/rl/sessions", headers=other_h).status_code == 401
    for path in SESSION_ROUTES:  # the admin key where a session key belongs
        assert httpx.post(gw.url + path, json={"reward": 1.0}, headers=AUTH).status_code == 401
        if path.startswith("/rl/v1/") and path != "/rl/v1/end_session":  # those live under /s/
            r = httpx.post(gw.url + f"/s/{ADMIN}{path}", json={"reward": 1.0})
            assert r.status_code == 401, path
    for path, body in WIRE:  # the admin key in a session's URL
        assert httpx.post(gw.url + f"/s/{ADMIN}{path}", json=body).status_code == 401, path
    assert httpx.get(gw.url + f"/s/{ADMIN}/v1/models").status_code == 401
    # another session's key only ever reaches that other session
    for path, body in WIRE:
        httpx.post(gw.url + path, json=body, headers=other_h).raise_for_status()
    victim_s = gw.deps.store.get(victim["session_id"], touch=False)
    assert len(victim_s.interactions) == 1 and victim_s.is_open
    assert victim_s.interactions[0].reward is None and victim_s.final_reward is None
    assert calls(gw, other["session_id"]) == len(WIRE)


# ---- item 10: no open control plane, JSON content types, Host on loopback --------------------

@pytest.fixture
def keyless(model_dir: str) -> Iterator[Gateway]:
    from relayrl.engine.fake import FakeEngine

    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=None, max_staleness=None)
    thread = GatewayThread(build_deps(cfg, engine=FakeEngine(lambda r: "ok",
                                                             tokenizer_path=model_dir))).start()
    yield Gateway(thread.url, thread)
    thread.stop()


def test_without_an_admin_key_the_control_routes_are_off(keyless: Gateway) -> None:
    for path in ADMIN_ROUTES:
        r = httpx.post(keyless.url + path, json={"session_id": "x"})
        assert r.status_code == 401 and "control routes are off" in r.text, path
    assert httpx.get(keyless.url + "/rl/v1/start_session").status_code == 401
    assert httpx.get(keyless.url + "/rl/sessions").status_code == 401
    assert len(keyless.deps.store) == 0
    # trying the model by hand still works, unrecorded
    httpx.post(keyless.url + "/v1/chat/completions", json=CHAT).raise_for_status()


def test_generated_admin_key_goes_to_a_private_file_and_is_reused(tmp_path: Path) -> None:
    path = tmp_path / "run" / "gateway.admin_key"
    cfg, written = ensure_admin_key(GatewayConfig(), path)
    assert written == path and cfg.admin_key and len(cfg.admin_key) >= 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again, _ = ensure_admin_key(GatewayConfig(), path)
    assert again.admin_key == cfg.admin_key
    given, none = ensure_admin_key(GatewayConfig(admin_key="mine-" * 8), path)
    assert given.admin_key == "mine-" * 8 and none is None


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_json_routes_refuse_bodies_not_declared_as_json(gw: Gateway,
                                                        content_type: str | None) -> None:
    import json

    headers = dict(AUTH)
    if content_type:
        headers["content-type"] = content_type
    for path, body in [("/rl/v1/start_session", {}), *WIRE]:
        r = httpx.post(gw.url + path, content=json.dumps(body).encode(), headers=headers)
        assert r.status_code == 415, (path, r.status_code)
        shape = r.json()
        assert ("type" in shape and shape["type"] == "error") if path.endswith("messages") \
            else "error" in shape
    assert len(gw.deps.store) == 0
    ok = {**AUTH, "content-type": "application/json; charset=utf-8"}
    assert httpx.post(gw.url + "/rl/v1/start_session", content=b"{}", headers=ok).status_code == 200


def test_a_loopback_gateway_answers_only_to_loopback_host_names(gw: Gateway) -> None:
    port = gw.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "10.0.0.1"):
        r = httpx.get(gw.url + "/health", headers={"host": host})
        assert r.status_code == 403, host
        # the routes served before Starlette's middleware (app._GatewayApp.fast) check it too
        for path, body in [("/rl/v1/start_session", {}), ("/rl/start_session", {}), *WIRE]:
            r = httpx.post(gw.url + path, json=body, headers={**AUTH, "host": host})
            assert r.status_code == 403, (path, host)
    for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}", "[::1]",
                 f"[::1]:{port}", "LOCALHOST:1"):
        assert httpx.get(gw.url + "/health", headers={"host": host}).status_code == 200, host
    assert len(gw.deps.store) == 0


# ---- item 11: the OpenAPI document lists every route, wire routes with their body schemas ----

def test_the_openapi_document_lists_every_route_with_its_body(gw: Gateway) -> None:
    from starlette.routing import Route

    doc = httpx.get(gw.url + "/openapi.json").json()
    paths = doc["paths"]
    for route in gw.thread.app.routes:
        if isinstance(route, Route) and route.path not in ("/openapi.json",):
            for method in route.methods or ():
                if method != "HEAD":
                    assert method.lower() in paths.get(route.path, {}), (method, route.path)
    bodies = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/responses": "ResponsesRequest",
              "/v1/messages": "MessagesRequest", "/rl/v1/finalize": "FinalizeV1",
              "/s/{session_key}/v1/messages": "MessagesRequest"}
    for path, model in bodies.items():
        ref = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model) and model in doc["components"]["schemas"]
    keyed = paths["/s/{session_key}/v1/chat/completions"]["post"]["parameters"]
    assert {"name": "session_key", "in": "path", "required": True,
            "schema": {"type": "string"}} in keyed


# ---- no key material in logs, answers, exports or the durable log ---------------------------

CLIENT_LIBRARIES = ("httpx", "httpcore", "openai", "anthropic")
"""Loggers of the HTTP clients the test itself uses: they log the URLs they request (httpx at
INFO), which for a `/s/{key}/v1` base URL is the key; that is the client's log, not the
gateway's (docs/protocol.md says so and recommends the header where an agent can send one)."""


def test_a_full_session_leaves_no_key_in_logs_answers_exports_or_the_log_file(
        model_dir: str, tmp_path: Path) -> None:
    class Capture(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            if not record.name.startswith(CLIENT_LIBRARIES):
                self.lines.append(f"{record.name} {self.format(record)}")

    capture = Capture()
    capture.setFormatter(logging.Formatter("%(message)s %(exc_text)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(capture)
    root.setLevel(logging.DEBUG)
    log_file = tmp_path / "calls.sqlite"
    g = fake_gateway(model_dir, tmp_log=str(log_file))
    answers: list[str] = []
    try:
        g.script.replies += ["one", "two", "three"]
        s = start(g, group_id="grp", metadata={"m": 1})
        key, keyed = s["api_key"], f"/s/{s['api_key']}"
        h = {"authorization": f"Bearer {key}"}
        client = OpenAI(base_url=s["base_url"], api_key="x", max_retries=0)
        r = client.chat.completions.create(model="m", messages=MSG)
        hist = [*MSG, {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "more"}]
        for req in (httpx.post(g.url + "/v1/chat/completions", json={"model": "m",
                               "messages": hist, "stream": True}, headers=h),
                    httpx.post(g.url + keyed + "/v1/messages", json={**ANTHROPIC, "x_y": 1}),
                    httpx.post(g.url + keyed + "/rl/v1/set_reward", json={"reward": 0.5}),
                    httpx.post(g.url + keyed + "/v1/chat/completions", json={"model": 1}),
                    httpx.get(g.url + keyed + "/v1/unknown"),
                    httpx.post(g.url + keyed + "/v1/chat/completions", content=b"{",
                               headers={"content-type": "application/json"}),
                    httpx.post(g.url + "/rl/v1/finalize", json={"final_reward": 1.0}, headers=h),
                    httpx.post(g.url + keyed + "/rl/v1/finalize", json={}),
                    httpx.post(g.url + keyed + "/v1/chat/completions", json=CHAT),
                    httpx.get(g.url + "/rl/sessions?state=ended", headers=AUTH),
                    httpx.get(g.url + "/rl/v1/status"), httpx.get(g.url + "/health"),
                    httpx.post(g.url + "/export_trajectories", headers=AUTH,
                               json={"session_id": s["session_id"], "style": "individual"}),
                    httpx.post(g.url + "/export_trajectories", headers=AUTH,
                               json={"session_id": s["session_id"], "ack": True})):
            answers.append(req.text)
        assert '"rows"' in answers[-1] and '"already_finalized":true' in answers[7].replace(" ", "")
    finally:
        g.thread.stop()
        root.removeHandler(capture)
        root.setLevel(old_level)
    assert any(line.startswith("relayrl") for line in capture.lines)  # the capture saw the gateway
    for text in [*capture.lines, *answers]:
        assert key not in text and keyed not in text
    db = sqlite3.connect(log_file)
    dump = "\n".join(db.iterdump())
    db.close()
    assert key not in dump and s["session_id"] in dump
