"""`gateway.replicas: N` / `relayrl gateway --replicas N`: N gateway + engine pairs behind one
router, whose URL is the one printed; sessions spread over the replicas; calls through the one
URL work. `relayrl train` and `relayrl serve` take the key too (tests/launch/test_replicas_train.py)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from relayrl.config import RelayConfig, load_config
from relayrl.errors import ConfigError
from relayrl.launch.local import LocalLauncher
from relayrl.launch.replicas import replica_log_path
from relayrl.service.launcher import ServiceLauncher

SRC = str(Path(__file__).resolve().parents[2] / "src")
ADMIN = "replicas-admin-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_config_key_is_checked_and_taken_by_the_launchers() -> None:
    cfg = load_config(RelayConfig, None, ["gateway.replicas=2"])
    assert cfg.gateway.replicas == 2
    with pytest.raises(ConfigError, match="replicas"):
        load_config(RelayConfig, None, ["gateway.replicas=0"])
    for launcher in (LocalLauncher, ServiceLauncher):  # both run replicas (test_replicas_train)
        assert launcher(cfg).config.gateway.replicas == 2
    assert replica_log_path("runs/x/sessions.db", 1, 2) == "runs/x/sessions.r1.db"
    assert replica_log_path("runs/x/sessions.db", 0, 1) == "runs/x/sessions.db"


def test_relayrl_gateway_with_two_replicas_serves_one_url(model_dir: str, tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "gateway", "--engine", "fake", "--model", model_dir,
         "--replicas", "2", "--port", str(port), "--admin-key", ADMIN,
         "--log", str(tmp_path / "sessions.db")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "listening at" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "relayrl gateway exited"
        match = re.search(r"listening at (\S+) \(a router in front of 2 replicas: (.+)\)", line)
        assert match, line
        url, replicas = match.group(1), match.group(2).split(", ")
        assert url == f"http://127.0.0.1:{port}" and len(replicas) == 2 and url not in replicas

        auth = {"authorization": f"Bearer {ADMIN}"}
        sessions = []
        with httpx.Client(timeout=30) as c:
            for _ in range(4):
                r = c.post(url + "/rl/v1/start_session", json={}, headers=auth)
                assert r.status_code == 200, r.text
                sessions.append(r.json())
            for s in sessions:
                assert s["base_url"].startswith(url + "/s/")  # the one URL, not a replica's
                r = c.post(s["base_url"] + "/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["role"] == "assistant"
            held = [sum(c.post(g + "/export_trajectories", json={"session_id": s["session_id"]},
                               headers=auth).status_code == 200 for s in sessions)
                    for g in replicas]
            assert held == [2, 2]  # least-loaded: both replicas got sessions
            assert c.get(url + "/health").json()["backends_healthy"] == 2
        assert sorted(p.name for p in tmp_path.glob("sessions.r*.db")) == [
            "sessions.r0.db", "sessions.r1.db"]  # one durable log per replica
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
