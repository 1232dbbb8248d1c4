"""Tenants: each API key (stored hashed) reaches only its own gateways, sessions and jobs."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from relayrl.errors import ConfigError
from relayrl.router import RouterConfig, RouterThread, key_digest, load_tenants
from tests.router.conftest import Backend, start_backend, start_router

KEY_A = "tenant-a-secret-key-0001"
KEY_B = "tenant-b-secret-key-0002"
GATEWAY_KEY_B = "b-gateway-admin-key-xyz"
HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def tenants(model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            caplog: pytest.LogCaptureFixture) -> Iterator[tuple[RouterThread, Backend, Backend]]:
    """Tenant a: its gateway's admin key is its own key (passed through). Tenant b: its gateway
    has another admin key, which the router swaps in (backend_key_env)."""
    caplog.set_level(logging.DEBUG)
    a = start_backend(model_dir, admin_key=KEY_A)
    b = start_backend(model_dir, admin_key=GATEWAY_KEY_B)
    monkeypatch.setenv("B_GATEWAY_KEY", GATEWAY_KEY_B)
    path = tmp_path / "tenants.yaml"
    path.write_text(
        "tenants:\n"
        f"  - {{name: a, api_key_sha256: {key_digest(KEY_A)}, backends: [{a.url}]}}\n"
        f"  - {{name: b, api_key_sha256: {key_digest(KEY_B)}, backends: [{b.url}],"
        " backend_key_env: B_GATEWAY_KEY}\n")
    assert KEY_A not in path.read_text() and KEY_B not in path.read_text()
    router = start_router(RouterConfig(tenants=load_tenants(path), health_interval_s=0.2))
    yield router, a, b
    router.stop()
    a.stop()
    b.stop()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for key in (KEY_A, KEY_B, GATEWAY_KEY_B):
        assert key not in logged


def test_each_tenant_reaches_its_own_gateway(tenants) -> None:
    router, a, b = tenants
    sa = httpx.post(router.url + "/rl/v1/start_session", json={}, headers=bearer(KEY_A)).json()
    sb = httpx.post(router.url + "/rl/v1/start_session", json={}, headers=bearer(KEY_B)).json()
    assert a.holds(sa["session_id"]) and not b.holds(sa["session_id"])
    assert b.holds(sb["session_id"]) and not a.holds(sb["session_id"])
    for s in (sa, sb):
        r = httpx.post(s["base_url"] + "/chat/completions", json=HI)
        assert r.status_code == 200
    listed = httpx.get(router.url + "/rl/sessions?state=open", headers=bearer(KEY_B)).json()
    assert [s["session_id"] for s in listed["sessions"]] == [sb["session_id"]]
    exported = httpx.post(router.url + "/export_trajectories", headers=bearer(KEY_A),
                          json={"session_id": sa["session_id"]})
    assert exported.status_code == 200 and len(exported.json()["rows"]) == 1
    v = httpx.post(router.url + "/rl/v1/set_version", json={"version": 5}, headers=bearer(KEY_B))
    assert v.status_code == 200 and b.deps.announced_version == 5
    assert a.deps.announced_version != 5  # another tenant's job is untouched


def test_a_tenant_never_reaches_another_tenants_sessions(tenants) -> None:
    router, a, _ = tenants
    sa = httpx.post(router.url + "/rl/v1/start_session", json={}, headers=bearer(KEY_A)).json()
    sb = httpx.post(router.url + "/rl/v1/start_session", json={}, headers=bearer(KEY_B)).json()
    httpx.post(sa["base_url"] + "/chat/completions", json=HI).raise_for_status()
    a_id = sa["session_id"]
    for path in ("/export_trajectories", "/rl/ack_export", "/rl/abort_session"):
        r = httpx.post(router.url + path, json={"session_id": a_id}, headers=bearer(KEY_B))
        assert r.status_code == 404, (path, r.text)
        assert a.url not in r.text and "hello" not in r.text
    # b's session key, pointed at a's session by id
    r = httpx.post(f"{router.url}/sessions/{a_id}/v1/chat/completions", json=HI,
                   headers=bearer(sb["api_key"]))
    assert r.status_code == 404
    # b's own key, at a's session by id path
    r = httpx.post(f"{router.url}/sessions/{a_id}/v1/chat/completions", json=HI,
                   headers=bearer(KEY_B))
    assert r.status_code == 404
    # b's session key cannot list or export at all (admin routes need the tenant key)
    assert httpx.get(router.url + "/rl/sessions", headers=bearer(sb["api_key"])).status_code == 401
    # nothing happened to a's session
    session = a.deps.store.get(a_id, touch=False)
    assert str(session.state) == "open" and len(session.interactions) == 1
    assert httpx.get(router.url + "/rl/sessions?state=open",
                     headers=bearer(KEY_A)).json()["sessions"][0]["session_id"] == a_id


@pytest.mark.parametrize("headers", [{}, bearer("not-a-tenant-key-123456"), {"x-api-key": "x"}])
def test_unknown_keys_are_refused_without_detail(tenants, headers: dict) -> None:
    router, _, _ = tenants
    for method, path in (("POST", "/rl/v1/start_session"), ("GET", "/rl/sessions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/rl/v1/status")):
        r = httpx.request(method, router.url + path, headers=headers, json=HI)
        assert r.status_code == 401
        assert r.json()["error"]["message"] == "invalid API key"
    health = httpx.get(router.url + "/health").json()
    assert health["backends_healthy"] == 2 and "backends" not in health  # no addresses


def test_tenant_files_keep_keys_hashed_and_gateways_unshared(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps([{"name": "a", "api_key": "plain", "backends": ["http://x:1"]}]))
    with pytest.raises(ConfigError, match="hashed"):
        load_tenants(bad)
    digest = key_digest("k")
    bad.write_text(json.dumps([{"name": "a", "api_key_sha256": digest, "backends": ["http://x:1"]},
                               {"name": "b", "api_key_sha256": key_digest("j"),
                                "backends": ["http://x:1"]}]))
    with pytest.raises(ConfigError, match="listed twice"):
        RouterConfig(tenants=load_tenants(bad)).validate()
    bad.write_text(json.dumps([{"name": "a", "api_key_sha256": "abc", "backends": ["http://x:1"]}]))
    with pytest.raises(ConfigError, match="64 hex"):
        load_tenants(bad)


def test_a_backend_key_that_would_break_a_header_line_is_refused(tmp_path: Path,
                                                                 monkeypatch) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"name": "a", "api_key_sha256": key_digest("k"),
                                 "backends": ["http://x:1"], "backend_key_env": "A_KEY"}]))
    monkeypatch.setenv("A_KEY", "key\r\nx-forged: 1")
    with pytest.raises(ConfigError, match="printable"):
        load_tenants(path)
    monkeypatch.setenv("A_KEY", "a-fine-key")
    assert load_tenants(path)[0].backend_key == "a-fine-key"
