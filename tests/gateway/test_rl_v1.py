"""The `/rl/v1/*` routes on the wire: start (GET/POST, groups, validation), key-addressed session
URLs, abort by the session's own key, status."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from relayrl.trajectory import SessionState
from tests.gateway.conftest import ADMIN, Gateway

AUTH = {"authorization": f"Bearer {ADMIN}"}


def key_headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_start_session_by_get_and_post_carries_the_group(gw: Gateway) -> None:
    g = httpx.get(gw.url + "/rl/v1/start_session", params={"group_id": "p1"}, headers=AUTH)
    p = httpx.post(gw.url + "/rl/v1/start_session", json={"task_id": "p1"}, headers=AUTH)
    assert g.status_code == p.status_code == 200
    for r in (g, p):
        body = r.json()
        assert body["group_id"] == "p1"
        assert gw.deps.store.get(body["session_id"]).task_id == "p1"
        # the session's URL carries its key, never its id
        assert body["base_url"].endswith(f"/s/{body['api_key']}/v1")
        assert body["session_id"] not in body["base_url"]


@pytest.mark.parametrize(("method", "kwargs", "needle"), [
    ("get", {"params": {"bogus": "1"}}, "unknown query parameters"),
    ("post", {"json": {"group_id": "a", "task_id": "b"}}, "group_id and task_id"),
    ("post", {"json": {"api_key": "short"}}, "URL-safe"),
    ("post", {"json": {"api_key": "has/a/slash/in/it/xxxxxxxx"}}, "URL-safe"),
    ("post", {"json": {"group": "typo"}}, "invalid group"),
])
def test_bad_start_requests_get_a_clear_400(gw: Gateway, method: str, kwargs: dict,
                                            needle: str) -> None:
    r = getattr(httpx, method)(gw.url + "/rl/v1/start_session", headers=AUTH, **kwargs)
    assert r.status_code == 400 and needle in r.json()["error"]["message"]


def test_start_needs_the_admin_key_when_one_is_set(gw: Gateway) -> None:
    r = httpx.post(gw.url + "/rl/v1/start_session", json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_the_key_addressed_url_serves_and_records_into_its_session(gw: Gateway) -> None:
    s = httpx.post(gw.url + "/rl/v1/start_session", json={}, headers=AUTH).json()
    client = OpenAI(base_url=s["base_url"], api_key="ignored", max_retries=0)
    assert [m.id for m in client.models.list()] == ["relayrl-test"]
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    root = s["base_url"][: -len("/v1")]
    httpx.post(root + "/rl/v1/set_reward", json={"completion_id": r.id, "reward": 0.25}) \
        .raise_for_status()
    fin = httpx.post(root + "/rl/v1/finalize", json={"final_reward": 1.0})
    assert fin.json() == {"session_id": s["session_id"], "state": "ended", "final_reward": 1.0,
                          "already_finalized": False}
    session = gw.deps.store.get(s["session_id"])
    assert [c.reward for c in session.interactions] == [0.25]
    bad = OpenAI(base_url=gw.url + "/s/" + "x" * 43 + "/v1", api_key="k", max_retries=0)
    with pytest.raises(Exception, match="invalid or missing session key") as e:
        bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert s["api_key"] not in str(e.value)


def test_abort_by_session_key_is_final_and_never_trained(gw: Gateway) -> None:
    s = httpx.post(gw.url + "/rl/v1/start_session", json={}, headers=AUTH).json()
    h = key_headers(s["api_key"])
    r = httpx.post(gw.url + "/rl/v1/abort", json={"reason": "ValueError"}, headers=h)
    assert r.status_code == 200 and r.json()["state"] == "aborted"
    assert gw.deps.store.get(s["session_id"]).state == SessionState.ABORTED
    fin = httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": 1.0}, headers=h)
    assert fin.status_code == 409
    assert httpx.post(gw.url + "/rl/v1/abort", json={}).status_code == 401


def test_on_finalize_hears_each_trajectory_once(gw: Gateway) -> None:
    from relayrl.gateway.routes_rl_v1 import state_of

    heard: list[str] = []
    state_of(gw.thread.app).on_finalize = lambda session: heard.append(session.id)
    s = httpx.post(gw.url + "/rl/v1/start_session", json={}, headers=AUTH).json()
    for reward in (1.0, 1.0, 0.0):
        httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": reward},
                   headers=key_headers(s["api_key"])).raise_for_status()
    assert heard == [s["session_id"]]


def test_status_reports_versions_sessions_and_recent_rewards(gw: Gateway) -> None:
    keys = []
    for _ in range(3):
        keys.append(httpx.post(gw.url + "/rl/v1/start_session", json={}, headers=AUTH).json())
    for s, reward in zip(keys[:2], (1.0, 0.0), strict=True):
        httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": reward},
                   headers=key_headers(s["api_key"])).raise_for_status()
    st = httpx.get(gw.url + "/rl/v1/status").json()
    assert st["relayrl_version"] and st["policy_version"] == 0 and st["model"] == "relayrl-test"
    assert st["sessions"]["open"] == 1 and st["sessions"]["finished_waiting"] == 2
    assert st["recent_reward"] == {"count": 2, "mean": 0.5}
    assert httpx.get(gw.url + "/health").json()["status"] == "ok"


def test_a_finalized_session_that_expired_is_forgotten_whole(gw: Gateway) -> None:
    """An ended session aborted by its TTL and then forgotten answers like any unknown key, not
    as "exported" (and the gateway keeps nothing of it)."""
    s = httpx.post(gw.url + "/rl/v1/start_session", json={}, headers=AUTH).json()
    httpx.post(gw.url + "/rl/v1/finalize", json={"final_reward": 1.0},
               headers=key_headers(s["api_key"])).raise_for_status()
    store = gw.deps.store
    store.abort(s["session_id"])  # what the ended-session TTL does
    store.remove(s["session_id"])  # ... and, ttl_s later, forgetting it
    late = httpx.post(gw.url + "/rl/v1/finalize", json={}, headers=key_headers(s["api_key"]))
    assert late.status_code == 401, late.text
    st = httpx.get(gw.url + "/rl/v1/status").json()["sessions"]
    assert st["aborted_total"] == 1 and st["finished_waiting"] == 0 and st["aborted"] == 0
