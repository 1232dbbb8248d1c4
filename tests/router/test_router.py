"""The router on the wire: affinity, byte-identical relaying, admin fan-out, dead backends."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from relayrl.client.session_client import SessionClient
from relayrl.router import RouterConfig, RouterThread
from tests.router.conftest import ADMIN, Backend, start_backend, start_router

AUTH = {"authorization": f"Bearer {ADMIN}"}
HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def start(router: RouterThread, i: int) -> dict:
    if i % 2:
        r = httpx.get(router.url + "/rl/v1/start_session", params={"group_id": f"g{i}"},
                      headers=AUTH)
    else:
        r = httpx.post(router.url + "/rl/start_session", json={"task_id": f"g{i}"}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def owner(backends: list[Backend], session_id: str) -> int:
    held = [i for i, b in enumerate(backends) if b.holds(session_id)]
    assert len(held) == 1, held
    return held[0]


def test_sessions_spread_and_every_call_reaches_the_gateway_holding_it(
        backends: list[Backend], router: RouterThread) -> None:
    sessions = [start(router, i) for i in range(8)]
    owners = [owner(backends, s["session_id"]) for s in sessions]
    assert sorted(owners.count(i) for i in range(2)) == [4, 4]  # least loaded first
    for n, s in enumerate(sessions):
        key = s["api_key"]
        if "base_url" in s:  # /rl/v1: the session URL is the router's, the key in its path
            assert s["base_url"] == f"{router.url}/s/{key}/v1"
            client = OpenAI(base_url=s["base_url"], api_key="unused", max_retries=0)
        else:  # /rl: the key as a bearer token
            client = OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)
        first = client.chat.completions.create(**HI)
        client.chat.completions.create(model="m", messages=[
            *HI["messages"], {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": f"more {n}"}])
        httpx.post(router.url + "/rl/v1/finalize", headers={"x-api-key": key},
                   json={"final_reward": float(n)}).raise_for_status()
    for s, o in zip(sessions, owners, strict=True):
        # the holder saw both calls, in one session, and the reward; the other gateway none
        with backends[o].admin() as c:
            rows = c.post("/export_trajectories", json={"session_id": s["session_id"]}).json()
        assert len(rows["rows"]) == 1 and rows["state"] == "ended"
        assert len(backends[o].deps.store.get(s["session_id"]).interactions) == 2
        assert not backends[1 - o].holds(s["session_id"])
        # export through the router reaches the owner and gives the same rows
        via = httpx.post(router.url + "/export_trajectories", headers=AUTH,
                         json={"session_id": s["session_id"], "ack": True})
        assert via.status_code == 200 and via.json()["rows"] == rows["rows"]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {**HI, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/responses", {"model": "m", "input": "hi", "stream": True}),
    ("/v1/messages", {"model": "m", "max_tokens": 32, "stream": True,
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", HI),
])
def test_completions_are_relayed_byte_for_byte(backends: list[Backend], router: RouterThread,
                                               path: str, body: dict) -> None:
    s = start(router, 0)
    o = owner(backends, s["session_id"])
    before = len(backends[o].sent.answers)
    with httpx.stream("POST", router.url + path, json=body,
                      headers={"authorization": f"Bearer {s['api_key']}"}) as r:
        assert r.status_code == 200
        got = b"".join(r.iter_raw())
        kind = r.headers["content-type"]
    sent = [a for a in backends[o].sent.answers[before:] if a[0] == path]
    assert len(sent) == 1 and sent[0][1] == 200
    assert got == sent[0][2]  # exactly the bytes the gateway sent
    assert kind.startswith("text/event-stream") == body.get("stream", False)
    assert b"hello there" in got or b"hello" in got


def test_admin_routes_fan_out_or_reach_the_owner(backends: list[Backend],
                                                 router: RouterThread) -> None:
    sessions = [start(router, i) for i in range(4)]
    listed = httpx.get(router.url + "/rl/sessions", params={"state": "open"}, headers=AUTH)
    assert listed.status_code == 200
    assert {s["session_id"] for s in listed.json()["sessions"]} == \
        {s["session_id"] for s in sessions}
    v = httpx.post(router.url + "/rl/v1/set_version", json={"version": 3}, headers=AUTH)
    assert v.status_code == 200 and v.json()["backends"] == 2
    assert [b.deps.announced_version for b in backends] == [3, 3]
    back = httpx.post(router.url + "/rl/v1/set_version", json={"version": 1}, headers=AUTH)
    assert back.status_code == 400 and "only move forward" in back.json()["error"]["message"]
    status = httpx.get(router.url + "/rl/v1/status").json()
    assert status["sessions"]["open"] == 4 and status["backends"] == {"healthy": 2, "total": 2}
    # abort by id goes to the owner only
    sid = sessions[0]["session_id"]
    o = owner(backends, sid)
    r = httpx.post(router.url + "/rl/abort_session", json={"session_id": sid}, headers=AUTH)
    assert r.status_code == 200 and r.json()["state"] == "aborted"
    assert str(backends[o].deps.store.get(sid, touch=False).state) == "aborted"
    missing = httpx.post(router.url + "/rl/ack_export", json={"session_id": "nope"}, headers=AUTH)
    assert missing.status_code == 404 and "error" in missing.json()
    # no admin key: the gateways' own 401, unchanged
    assert httpx.get(router.url + "/rl/sessions").status_code == 401


def test_a_dead_backends_sessions_get_503_and_new_sessions_avoid_it(
        backends: list[Backend], router: RouterThread) -> None:
    sessions = [start(router, i) for i in range(4)]
    owners = [owner(backends, s["session_id"]) for s in sessions]
    backends[0].stop()
    dead = [s for s, o in zip(sessions, owners, strict=True) if o == 0]
    alive = [s for s, o in zip(sessions, owners, strict=True) if o == 1]
    r = httpx.post(router.url + "/v1/chat/completions", json=HI,
                   headers={"authorization": f"Bearer {dead[0]['api_key']}"})
    assert r.status_code == 503
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and "gateway" in err["message"]
    m = httpx.post(router.url + "/v1/messages", headers={"x-api-key": dead[-1]["api_key"]},
                   json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
    assert m.status_code == 503 and m.json()["type"] == "error"  # Anthropic's shape there
    ok = httpx.post(router.url + "/v1/chat/completions", json=HI,
                    headers={"authorization": f"Bearer {alive[0]['api_key']}"})
    assert ok.status_code == 200
    fresh = [start(router, i) for i in range(4)]
    assert all(backends[1].holds(s["session_id"]) for s in fresh)
    health = httpx.get(router.url + "/health").json()
    assert health["backends_healthy"] == 1 and health["backends"][0]["healthy"] is False


def test_health_checks_notice_a_dead_backend_without_traffic(backends: list[Backend],
                                                             router: RouterThread) -> None:
    backends[1].stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if httpx.get(router.url + "/health").json()["backends_healthy"] == 1:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the router never noticed the dead backend")
    assert all(backends[0].holds(start(router, i)["session_id"]) for i in range(3))


def test_a_session_started_behind_the_routers_back_is_still_found(
        backends: list[Backend], router: RouterThread) -> None:
    with backends[1].admin() as c:  # not through the router: it has no binding for this key
        s = c.post("/rl/v1/start_session", json={}).json()
    r = httpx.post(f"{router.url}/s/{s['api_key']}/v1/chat/completions", json=HI)
    assert r.status_code == 200
    assert len(backends[1].deps.store.get(s["session_id"]).interactions) == 1


def test_a_caller_chosen_key_cannot_be_reused_across_backends(router: RouterThread) -> None:
    key = "k" * 32
    assert httpx.post(router.url + "/rl/v1/start_session", json={"api_key": key},
                      headers=AUTH).status_code == 200
    again = httpx.post(router.url + "/rl/v1/start_session", json={"api_key": key}, headers=AUTH)
    assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]


def test_oversized_bodies_are_refused_before_any_backend(backends: list[Backend],
                                                         router: RouterThread) -> None:
    router.router.config.max_body_bytes = 4096
    def calls() -> list[int]:
        return [sum(a[0] != "/health" for a in b.sent.answers) for b in backends]

    before = calls()
    big = {**HI, "messages": [{"role": "user", "content": "x" * 10_000}]}
    r = httpx.post(router.url + "/v1/chat/completions", json=big, headers=AUTH)
    assert r.status_code == 413 and "over 4096 bytes" in r.json()["error"]["message"]
    assert calls() == before


@pytest.fixture
def role_backends(model_dir: str) -> Iterator[list[Backend]]:
    """Two gateways that record a role per call (child sessions need `gateway.roles`)."""
    bs = [start_backend(model_dir, roles=True), start_backend(model_dir, roles=True)]
    yield bs
    for b in bs:
        b.stop()


@pytest.fixture
def role_router(role_backends: list[Backend]) -> Iterator[RouterThread]:
    r = start_router(RouterConfig(backends=[b.url for b in role_backends],
                                  health_interval_s=0.2, health_timeout_s=1.0))
    yield r
    r.stop()


async def test_a_child_sessions_url_is_the_routers_and_its_calls_reach_the_session(
        role_backends: list[Backend], role_router: RouterThread) -> None:
    async with SessionClient(role_router.url, ADMIN) as client:
        parent = await client.start_session()
        child = await client.child_session(parent, "solver")  # the key as a bearer token
        by_path = httpx.post(f"{role_router.url}/s/{parent.api_key}/rl/v1/child_session",
                             json={"role": "critic"}).json()
    scoped = f"{role_router.url}/s/{parent.api_key}/role"
    assert child.base_url == f"{scoped}/solver/v1"
    assert by_path["base_url"] == f"{scoped}/critic/v1"
    for url in (child.base_url, by_path["base_url"]):  # the sub-agent has only its URL
        r = httpx.post(url + "/chat/completions", json=HI, timeout=30)
        assert r.status_code == 200, r.text
    o = owner(role_backends, parent.session_id)
    calls = role_backends[o].deps.store.get(parent.session_id).interactions
    assert [c.role for c in calls] == ["solver", "critic"]


def test_a_child_session_of_a_session_the_router_never_saw_points_at_the_router(
        role_backends: list[Backend], role_router: RouterThread) -> None:
    with role_backends[1].admin() as c:  # not through the router: it has no binding for this key
        s = c.post("/rl/v1/start_session", json={}).json()
    r = httpx.post(role_router.url + "/rl/v1/child_session", json={"role": "solver"},
                   headers={"authorization": f"Bearer {s['api_key']}"})
    assert r.status_code == 200, r.text
    assert r.json()["base_url"] == f"{role_router.url}/s/{s['api_key']}/role/solver/v1"
    refused = httpx.post(role_router.url + "/rl/v1/child_session", json={"role": "solver"},
                         headers={"authorization": "Bearer not-a-session-key"})
    assert refused.status_code == 401
