"""Roles at the gateway over real HTTP: each source of a call's role, their precedence, the
role-scoped URL a child session hands out, per-role rewards, and what happens with roles off."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from relayrl.client.session_client import SessionClient
from relayrl.errors import ConfigError, InvalidRequest
from relayrl.gateway.config import GatewayConfig
from relayrl.trajectory.atif import session_to_atif
from tests.gateway.conftest import ADMIN, Gateway, fake_gateway
from tests.trajectory.harbor import harbor_validate, needs_harbor


@pytest.fixture(scope="module")
def rgw(model_dir: str) -> Iterator[Gateway]:
    g = fake_gateway(model_dir, roles=True, role_models={"triage-agent": "triage"})
    yield g
    g.thread.stop()


def _chat(url: str, key: str, content: str, model: str = "default",
          headers: dict[str, str] | None = None, base: str | None = None) -> httpx.Response:
    return httpx.post((base or url + "/v1") + "/chat/completions",
                      headers={"authorization": f"Bearer {key}", **(headers or {})},
                      json={"model": model, "messages": [{"role": "user", "content": content}],
                            "max_tokens": 4}, timeout=60)


def _roles(gw: Gateway, session_id: str) -> list[str | None]:
    return [c.role for c in gw.deps.store.get(session_id).interactions]


def test_every_source_names_the_role_in_the_documented_order(rgw: Gateway) -> None:
    s = rgw.start_session(metadata={"role": "player_0"})
    key = s["api_key"]
    _chat(rgw.url, key, "a").raise_for_status()                                  # metadata
    _chat(rgw.url, key, "b", model="default@solver").raise_for_status()           # model@role
    _chat(rgw.url, key, "c", model="triage-agent").raise_for_status()             # role_models
    _chat(rgw.url, key, "d", model="default@solver",
          headers={"x-relayrl-role": "critic"}).raise_for_status()                # header wins
    assert _roles(rgw, s["session_id"]) == ["player_0", "solver", "triage", "critic"]
    rows = rgw.export(s["session_id"], style="individual")
    assert [r["metadata"]["role"] for r in rows] == ["player_0", "solver", "triage", "critic"]


def test_a_session_without_a_role_records_calls_without_one(rgw: Gateway) -> None:
    s = rgw.start_session()
    _chat(rgw.url, s["api_key"], "x").raise_for_status()
    assert _roles(rgw, s["session_id"]) == [None]
    assert "role" not in rgw.export(s["session_id"])[0]["metadata"]


def test_a_bad_role_is_a_400_in_the_protocols_shape(rgw: Gateway) -> None:
    s = rgw.start_session()
    r = _chat(rgw.url, s["api_key"], "x", headers={"x-relayrl-role": "no spaces"})
    assert r.status_code == 400 and "x-relayrl-role" in r.json()["error"]["message"]
    r = _chat(rgw.url, s["api_key"], "x", model="default@bad/role")
    assert r.status_code == 400 and "not a role name" in r.json()["error"]["message"]
    assert _roles(rgw, s["session_id"]) == []  # nothing recorded


async def test_a_child_session_records_a_sub_agents_calls_in_the_session(rgw: Gateway) -> None:
    async with SessionClient(rgw.url, ADMIN) as client:
        parent = await client.start_session(metadata={"role": "triage"})
        child = await client.child_session(parent, "specialist")
        assert child.session_id == parent.session_id
        assert child.base_url.endswith(f"/s/{parent.api_key}/role/specialist/v1")
        _chat(rgw.url, parent.api_key, "route this").raise_for_status()
        # the sub-agent has only its URL (the key is in it) and sends a plain model name
        r = httpx.post(child.base_url + "/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": "solve"}],
            "max_tokens": 4}, timeout=60)
        r.raise_for_status()
        # the header still wins over the scoped URL
        _chat(rgw.url, "unused", "z", base=child.base_url,
              headers={"x-relayrl-role": "critic"}).raise_for_status()
        assert _roles(rgw, parent.session_id) == ["triage", "specialist", "critic"]
        await client.finalize(parent, final_reward=1.0, role_rewards={"specialist": 0.5})
        rows = await client.export(parent.session_id)
    by_role = {r["metadata"]["role"]: r["reward"] for r in rows}
    assert by_role == {"triage": 1.0, "specialist": 0.5, "critic": 1.0}


def test_finalize_refuses_a_bad_role_reward(rgw: Gateway) -> None:
    s = rgw.start_session()
    h = {"authorization": f"Bearer {s['api_key']}"}
    r = httpx.post(rgw.url + "/rl/v1/finalize", headers=h, timeout=60,
                   json={"final_reward": 1.0, "role_rewards": {"bad role": 1.0}})
    assert r.status_code == 400 and "role_rewards" in r.json()["error"]["message"]
    r = httpx.post(rgw.url + "/rl/v1/finalize", headers=h, timeout=60,
                   json={"role_rewards": {"a": "many"}})
    assert r.status_code in (400, 422)


def test_with_roles_off_no_call_has_a_role_and_scoped_urls_are_refused(model_dir: str) -> None:
    gw = fake_gateway(model_dir)
    try:
        s = gw.start_session(metadata={"role": "player_0"})
        key = s["api_key"]
        _chat(gw.url, key, "a", model="default@solver",
              headers={"x-relayrl-role": "critic"}).raise_for_status()
        assert _roles(gw, s["session_id"]) == [None]
        r = _chat(gw.url, key, "b", base=f"{gw.url}/s/{key}/role/solver/v1")
        assert r.status_code == 400 and "gateway.roles" in r.json()["error"]["message"]
        r = httpx.post(f"{gw.url}/s/{key}/rl/v1/child_session", json={"role": "x"}, timeout=60)
        assert r.status_code == 400 and "gateway.roles" in r.json()["error"]["message"]
    finally:
        gw.thread.stop()


def test_role_models_without_roles_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.roles"):
        GatewayConfig(role_models={"m": "r"})


def test_a_child_session_of_a_stranger_is_refused(rgw: Gateway) -> None:
    r = httpx.post(f"{rgw.url}/s/not-a-session-key-at-all/rl/v1/child_session",
                   json={"role": "x"}, timeout=60)
    assert r.status_code == 401
    r = httpx.post(f"{rgw.url}/s/not-a-session-key-at-all/role/x/v1/chat/completions",
                   json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                   timeout=60)
    assert r.status_code == 401


def _two_role_atif(rgw: Gateway) -> dict:
    s = rgw.start_session()
    key = s["api_key"]
    _chat(rgw.url, key, "plan", model="default@planner").raise_for_status()
    _chat(rgw.url, key, "solve", model="default@solver").raise_for_status()
    session = rgw.deps.store.get(s["session_id"])
    session.set_final_reward(1.0, role="solver")
    return session_to_atif(session)


def test_atif_names_each_roles_trajectory_after_its_role(rgw: Gateway) -> None:
    traj = _two_role_atif(rgw)
    assert traj["agent"]["name"] == "planner"
    assert traj["steps"][-1]["extra"]["role"] == "planner"
    (sub,) = traj["subagent_trajectories"]
    assert sub["agent"]["name"] == "solver" and sub["extra"]["role"] == "solver"
    assert sub["steps"][-1]["extra"]["role"] == "solver"
    assert traj["final_metrics"]["extra"]["role_rewards"] == {"solver": 1.0}


@needs_harbor
def test_harbors_validator_accepts_a_two_role_trajectory(rgw: Gateway, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_two_role_atif(rgw)))
    assert harbor_validate(path, "t.agent.name", "subs[0].agent.name") == ["planner", "solver"]


def test_role_names_are_checked_by_the_client_too() -> None:
    from relayrl.trajectory.roles import check_role

    with pytest.raises(InvalidRequest):
        check_role("")
