"""`relayrl rollout-server`'s settings (env, then flags) and a real server process on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from relayrl.remote_rollout.cli import build_parser, config_from_args
from relayrl.remote_rollout.config import ServerConfig


def test_env_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServerConfig.from_env({}) == ServerConfig()
    d = ServerConfig()
    assert (d.port, d.http_client_timeout, d.tokenizer_cache_size, d.max_concurrent_rollouts) == (
        9000, 300.0, 5, 100)
    monkeypatch.setenv("ROLLOUT_SERVER_PORT", "9100")
    monkeypatch.setenv("HTTP_CLIENT_TIMEOUT", "12.5")
    monkeypatch.setenv("TOKENIZER_TRUST_REMOTE_CODE", "true")
    monkeypatch.setenv("TOKENIZER_CACHE_SIZE", "2")
    c = config_from_args(build_parser().parse_args([]))
    assert (c.port, c.http_client_timeout, c.tokenizer_trust_remote_code,
            c.tokenizer_cache_size) == (9100, 12.5, True, 2)
    c = config_from_args(build_parser().parse_args(
        ["--port", "9200", "--http-client-timeout", "3", "--no-tokenizer-trust-remote-code",
         "--tool-delay-ms", "0", "0"]))
    assert (c.port, c.http_client_timeout, c.tokenizer_trust_remote_code) == (9200, 3.0, False)
    assert (c.tool_delay_min_s, c.tool_delay_max_s) == (0.0, 0.0)
    monkeypatch.setenv("TOKENIZER_TRUST_REMOTE_CODE", "maybe")
    with pytest.raises(ValueError, match="TOKENIZER_TRUST_REMOTE_CODE"):
        ServerConfig.from_env()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_process_serves_tools_and_health() -> None:
    port = _free_port()
    env = {**os.environ, "ROLLOUT_SERVER_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "relayrl.remote_rollout.cli"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):  # bounded: 30 s
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        health = httpx.get(f"{url}/health", timeout=5).json()
        assert health["status"] == "ok" and health["max_concurrent_rollouts"] == 100
        names = [t["function"]["name"] for t in httpx.get(f"{url}/tools", timeout=5).json()["tools"]]
        assert names == ["add", "subtract", "multiply", "divide"]
    finally:
        proc.terminate()
        proc.wait(10)
