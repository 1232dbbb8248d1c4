"""The rollout server's guards: an API key on `/rollout` and `/tools` (required to bind off
loopback), callbacks only to allowed hosts, tokenizers only by configured names.

Every refusal is answered in the protocol's error shape (`status: ERROR`, `error_message`,
`final_messages: []`) with a 401 or 403, before any callback or tokenizer load happens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import httpx
import pytest

from relayrl.errors import EpisodeFailed
from relayrl.remote_rollout import server as server_module
from relayrl.remote_rollout.config import ServerConfig

from .conftest import FakeGateway, start_rollout_server
from .test_workflow import run_episode

KEY = "rollout-server-key-0123456789abcdef"
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def _body(gw: FakeGateway, **extra: Any) -> dict[str, Any]:
    session = gw.start_session()
    return {"rollout_id": "r-auth", "messages": QUESTION,
            "server_url": session["base_url"].removesuffix("/v1"),
            "callback_api_key": session["api_key"],
            "sampling_params": {"temperature": 0.0, "max_tokens": 16}, **extra}


def _assert_refused(r: httpx.Response, status: int, words: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["status"] == "ERROR" and body["finish_reason"] == "error"
    assert body["final_messages"] == []
    assert words in body["error_message"], body["error_message"]
    return body


@pytest.fixture
def keyed_server():
    server, state = start_rollout_server(api_key=KEY)
    yield server, state
    server.stop()


def test_without_a_key_rollout_and_tools_are_401(gw: FakeGateway, keyed_server) -> None:
    server, state = keyed_server
    r = httpx.post(f"{server.url}/rollout", json=_body(gw), timeout=30)
    _assert_refused(r, 401, "no API key was sent")
    assert r.headers["www-authenticate"] == "Bearer"
    _assert_refused(httpx.get(f"{server.url}/tools", timeout=10), 401, "no API key")
    # nothing ran: no callback reached the gateway, no tokenizer was loaded
    assert gw.script.requests == [] and len(state.tokenizers) == 0
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_wrong_key_is_401_and_the_right_one_runs(gw: FakeGateway, keyed_server,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    server, _ = keyed_server
    compared: list[tuple[bytes, bytes]] = []
    real = server_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(server_module.hmac, "compare_digest", spy)
    for headers in ({"authorization": "Bearer " + KEY[:-1] + "X"}, {"x-api-key": "nope"},
                    {"authorization": "Basic " + KEY}):
        r = httpx.post(f"{server.url}/rollout", json=_body(gw), headers=headers, timeout=30)
        _assert_refused(r, 401, "unauthorized")
    assert gw.script.requests == []
    assert compared, "the key was not compared with hmac.compare_digest"
    gw.script.replies += ["5"]
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        r = httpx.post(f"{server.url}/rollout", json=_body(gw), headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["status"] == "COMPLETED", r.text
        assert httpx.get(f"{server.url}/tools", headers=headers, timeout=10).status_code == 200


def test_the_workflow_sends_the_servers_key(gw: FakeGateway, keyed_server,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    server, _ = keyed_server
    monkeypatch.delenv("ROLLOUT_SERVER_API_KEY", raising=False)
    with pytest.raises(EpisodeFailed, match="401"):
        run_episode(gw, server.url)
    gw.script.replies += ["The answer is 345."]
    rows, wf = run_episode(gw, server.url, server_api_key=KEY)
    assert rows is not None and wf.stats["completed"] == 1
    assert KEY not in repr(wf.config)  # a config's repr (logs) never shows the key
    monkeypatch.setenv("ROLLOUT_SERVER_API_KEY", KEY)
    gw.script.replies += ["The answer is 345."]
    rows, wf = run_episode(gw, server.url)
    assert rows is not None and wf.stats["completed"] == 1


def test_a_callback_host_not_allowed_is_refused(gw: FakeGateway, rollout_server) -> None:
    server, state = rollout_server
    for url in ("http://169.254.169.254/latest", "http://example.com:8000/s/k",
                "file:///etc/passwd", "http://10.1.2.3:8000"):
        r = httpx.post(f"{server.url}/rollout", json=_body(gw, server_url=url), timeout=30)
        body = _assert_refused(r, 403, "not")
        assert body["rollout_id"] == "r-auth"
    assert gw.script.requests == [] and state.errors == 0
    # loopback is allowed by default: the same request to the gateway runs
    gw.script.replies += ["5"]
    r = httpx.post(f"{server.url}/rollout", json=_body(gw), timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "COMPLETED", r.text


def test_allowed_callback_hosts_are_the_loopback_and_the_given_ones() -> None:
    c = ServerConfig(allowed_callback_hosts=("trainer.internal", "10.0.0.0/8", "192.168.1.5"))
    for ok in ("http://127.0.0.1:8000", "http://localhost:1/s/k", "http://[::1]:8000",
               "https://TRAINER.internal/s/k", "http://10.200.3.4:8081", "http://192.168.1.5"):
        assert c.callback_refusal(ok) is None, ok
    for bad in ("http://trainer.internal.evil.com", "http://11.0.0.1", "http://192.168.1.6",
                "ftp://127.0.0.1", "http:///nohost"):
        assert c.callback_refusal(bad) is not None, bad
    assert ServerConfig().callback_refusal("http://10.0.0.1") is not None
    with pytest.raises(ValueError, match="network"):
        ServerConfig(allowed_callback_hosts=("10.0.0.0/99",))


def test_a_tokenizer_not_configured_is_refused(gw: FakeGateway, model_dir: str) -> None:
    server, state = start_rollout_server(allowed_tokenizers=(model_dir,))
    try:
        for name in ("/etc", "../../secrets", "some-org/some-hub-model"):
            r = httpx.post(f"{server.url}/rollout", json=_body(gw, tokenizer_name=name),
                           timeout=30)
            _assert_refused(r, 403, f"tokenizer {name!r} is not served here")
        assert len(state.tokenizers) == 0 and gw.script.requests == []
        gw.script.replies += ["5", "5"]
        for name in (model_dir, ServerConfig().default_tokenizer):  # allowed, and the default
            r = httpx.post(f"{server.url}/rollout", json=_body(gw, tokenizer_name=name),
                           timeout=60)
            assert r.status_code == 200 and r.json()["status"] == "COMPLETED", r.text
    finally:
        server.stop()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relayrl.remote_rollout.cli", *args],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=60)


def test_off_loopback_without_a_key_it_refuses_to_start(tmp_path) -> None:
    env = {"ROLLOUT_SERVER_API_KEY": ""}
    done = _cli("--host", "0.0.0.0", "--port", "1", env=env)  # never binds: refused first
    assert done.returncode == 2
    assert "off loopback" in done.stderr and "ROLLOUT_SERVER_API_KEY" in done.stderr
    assert "listening" not in done.stdout
    empty = tmp_path / "key"
    empty.write_text("\n")
    done = _cli("--host", "0.0.0.0", "--port", "1", "--api-key-file", str(empty), env=env)
    assert done.returncode == 2 and "is empty" in done.stderr
    short = tmp_path / "short"
    short.write_text("abc\n")
    done = _cli("--host", "0.0.0.0", "--port", "1", "--api-key-file", str(short), env=env)
    assert done.returncode == 2 and "16 characters" in done.stderr


def test_guards_come_from_the_environment_then_flags(tmp_path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl.remote_rollout.cli import build_parser, config_from_args

    monkeypatch.setenv("ROLLOUT_SERVER_API_KEY", KEY)
    monkeypatch.setenv("ROLLOUT_ALLOWED_CALLBACK_HOSTS", "a.internal, 10.0.0.0/8,")
    monkeypatch.setenv("ROLLOUT_ALLOWED_TOKENIZERS", "/models/x")
    c = config_from_args(build_parser().parse_args([]))
    assert c.api_key == KEY and c.allowed_callback_hosts == ("a.internal", "10.0.0.0/8")
    assert c.tokenizer_names == (c.default_tokenizer, "/models/x")
    key_file = tmp_path / "key"
    key_file.write_text("k" * 20 + "\n")
    c = config_from_args(build_parser().parse_args(
        ["--api-key-file", str(key_file), "--allow-callback-host", "b.internal",
         "--allow-callback-host", "c.internal", "--allow-tokenizer", "/models/y"]))
    assert c.api_key == "k" * 20 and c.allowed_callback_hosts == ("b.internal", "c.internal")
    assert c.allowed_tokenizers == ("/models/y",)
    assert KEY not in repr(ServerConfig(api_key=KEY))
