"""`relayrl serve` with `gateway.replicas: 2`: agents reach one URL (a router), their sessions land
on both replicas, the trainer learns from all of them, both engines take every step's weights,
`/rl/v1/status` through the router shows the trainer, and SIGTERM still stops cleanly."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest

from relayrl.client import AgentRunner
from tests.service.test_serve import ADMIN, Service, _agent, _config, _free_port
from tests.train.conftest import tiny_llama_dir  # noqa: F401 - a fixture used below

pytestmark = pytest.mark.slow


def test_two_replicas_behind_one_url_train_and_both_take_the_weights(
        tmp_path: Path, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    port = _free_port()
    config = _config(tmp_path, tiny_llama_dir, port, gateway={"replicas": 2},
                     engine={"num_threads": 1})
    svc = Service(config, port, tmp_path / "serve.log")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{svc.url}/v1")
    monkeypatch.setenv("RELAYRL_API_KEY", ADMIN)
    try:
        line = re.search(r"relayrl service listening at (\S+) \(a router in front of 2 "
                         r"replicas: (.+)\)", svc.log.read_text())
        assert line, svc.log.read_text()[-2000:]
        assert line.group(1) == svc.url
        replicas = line.group(2).split(", ")
        assert len(replicas) == 2 and svc.url not in replicas

        data = [{"q": f"What is {i} + {i}?"} for i in range(3)]
        summary = asyncio.run(AgentRunner(group_size=2, concurrency=4).run(_agent, data))
        assert summary.finished == 6 and summary.aborted == 0
        status = svc.wait_for(lambda s: s["trainer"]["step"] >= 3, "three training steps")
        assert status["trainer"]["trajectories_trained"] == 6
        assert status["backends"] == {"healthy": 2, "total": 2}
        # every step's weights reach both engines: each replica serves the trainer's version
        # (the step counter moves just before the push, so give the push a moment)
        version = status["trainer"]["version"]
        assert version >= 3
        deadline = time.monotonic() + 30
        while True:
            health = [httpx.get(f"{r}/health", timeout=10).json() for r in replicas]
            if [h["version"] for h in health] == [version, version] or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [h["version"] for h in health] == [version, version], health
        assert svc.status()["policy_version"] == version
        assert all(h["exported_total"] > 0 for h in health), health  # both served agents
        assert sum(h["exported_total"] for h in health) == 6
        assert svc.stop() == 0
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()
    out = svc.log.read_text()
    checkpoints = sorted((tmp_path / "runs" / "svc" / "t" / "checkpoints").glob("step_*"))
    assert checkpoints and (checkpoints[-1] / "config.json").exists()
    logs = sorted(p.name for p in (tmp_path / "runs" / "svc" / "t").glob("sessions.r*.db"))
    assert logs == ["sessions.r0.db", "sessions.r1.db"]  # one durable log per replica
    assert ADMIN not in out
