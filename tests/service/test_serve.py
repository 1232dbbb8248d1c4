"""`relayrl serve` as a user runs it: a service process, agents driving their own sessions over
HTTP, the trainer learning from what they finalize, a clean SIGTERM, and kill -9 recovery.

The policy is a tiny randomly initialized Llama with the default model's tokenizer and template
(the real trainer, engine and gateway; only the weights are small, so steps take seconds).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from relayrl.client import AgentRunner, AgentSession
from tests.train.conftest import tiny_llama_dir  # noqa: F401 - a fixture used below

ADMIN = "service-admin-key-for-tests-0123456789"
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """A `relayrl serve` subprocess on a loopback port."""

    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli", "serve", str(config)],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while "relayrl service listening at" not in log.read_text():
            assert self.proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "service did not start in 180 s"
            time.sleep(0.2)

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/rl/v1/status", timeout=10).json()

    def wait_for(self, predicate: Any, what: str, timeout_s: float = 240.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.status()
            if predicate(s):
                return s
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}: {self.status()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 120.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)


def _config(tmp: Path, model: str, port: int, **extra: Any) -> Path:
    cfg = {
        "model": model, "fileroot": str(tmp / "runs"), "experiment_name": "svc",
        "trial_name": "t", "seed": 3,
        "gateway": {"port": port, "admin_key": ADMIN, "default_max_tokens": 8},
        "rollout": {"group_size": 2, "batch_size": 1, "max_staleness": 1},
        "train": {"total_steps": 1000, "checkpoint_every": 0, "bf16": False, "lr": 1e-4,
                  "drop_uniform_groups": False, "save_optimizer": False},
        "service": {"group_wait_s": 600.0, "poll_s": 0.1},
    }
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp / f"serve-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


async def _agent(item: dict[str, Any]) -> float:
    """An unmodified OpenAI-SDK agent: the session routing happens around it."""
    client = openai.AsyncOpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key="unused")
    reply = await client.chat.completions.create(
        model="policy", max_tokens=6, messages=[{"role": "user", "content": item["q"]}])
    await client.close()
    return float(len(reply.choices[0].message.content or "") % 2)


def test_agents_drive_training_and_sigterm_leaves_a_checkpoint(tmp_path: Path,
                                                                tiny_llama_dir: str,  # noqa: F811
                                                                monkeypatch) -> None:
    port = _free_port()
    svc = Service(_config(tmp_path, tiny_llama_dir, port), port, tmp_path / "serve.log")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{svc.url}/v1")
    monkeypatch.setenv("RELAYRL_API_KEY", ADMIN)
    try:
        data = [{"q": f"What is {i} + {i}?"} for i in range(3)]
        summary = asyncio.run(AgentRunner(group_size=2, concurrency=4).run(_agent, data))
        assert summary.finished == 6 and summary.aborted == 0
        status = svc.wait_for(lambda s: s["trainer"]["step"] >= 3, "three training steps")
        assert status["trainer"]["trajectories_trained"] == 6
        assert status["trainer"]["dropped_stale"] == 0
        assert svc.stop() == 0
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()
    out = svc.log.read_text()
    assert "relayrl: held-out reward" in out, out[-2000:]
    checkpoints = sorted((tmp_path / "runs" / "svc" / "t" / "checkpoints").glob("step_*"))
    assert checkpoints and (checkpoints[-1] / "config.json").exists()
    assert ADMIN not in out  # the admin key is never printed


def test_a_finalized_trajectory_survives_kill_9_and_is_trained_once(tmp_path: Path,
                                                                    tiny_llama_dir: str,  # noqa: F811
                                                                    monkeypatch) -> None:
    port = _free_port()
    config = _config(tmp_path, tiny_llama_dir, port, rollout={"group_size": 3})
    svc = Service(config, port, tmp_path / "first.log")
    monkeypatch.setenv("RELAYRL_API_KEY", ADMIN)
    try:
        async def two_of_three() -> None:
            for _ in range(2):
                async with AgentSession(base_url=svc.url, group_id="g") as s:
                    await _agent_at(svc.url, s)
                    s.set_reward(1.0)

        asyncio.run(two_of_three())
        svc.wait_for(lambda s: s["sessions"]["finished_waiting"] >= 2, "two finalized sessions",
                     timeout_s=30)
        assert svc.status()["trainer"]["step"] == 0  # the group of 3 is not complete
        svc.proc.kill()  # kill -9: nothing flushed on the way out
        svc.proc.wait(30)
        svc = Service(config, port, tmp_path / "second.log")

        async def the_third() -> None:
            async with AgentSession(base_url=svc.url, group_id="g") as s:
                await _agent_at(svc.url, s)
                s.set_reward(0.0)

        asyncio.run(the_third())
        status = svc.wait_for(lambda s: s["trainer"]["step"] >= 1, "the recovered group's step")
        assert status["trainer"]["trajectories_trained"] == 3  # two recovered + one new, once each
        time.sleep(1.0)
        assert svc.status()["trainer"]["trajectories_trained"] == 3
        assert svc.stop() == 0
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()


async def _agent_at(url: str, session: AgentSession) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/chat/completions", json={
            "model": "policy", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text


def test_a_sigterm_during_the_warm_start_still_stops_the_service(tmp_path: Path,
                                                                 tiny_llama_dir: str,  # noqa: F811
                                                                 model_dir: str) -> None:
    """The trainer asks for its batches only after the warm-start; a stop before that counts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "math_agent"))
    from teacher import generate_traces

    from relayrl.trajectory import read_jsonl

    traces = tmp_path / "traces.jsonl"
    generate_traces(model_dir, read_jsonl_items()[:4], 4, out_path=traces)
    assert read_jsonl(traces)
    port = _free_port()
    config = _config(tmp_path, tiny_llama_dir, port,
                     sft={"data": str(traces), "epochs": 40, "rows_per_step": 1})
    svc = Service(config, port, tmp_path / "warm.log")
    try:
        status = svc.status()
        assert status["trainer"]["batches"] == 0  # counters exist before the trainer asks
        assert status["trainer"]["phase"] == "warming_up"
        # no session starts on the weights from before SFT (they would be trained as version 0
        # of the warmed policy): a 429 that says why, with Retry-After
        r = httpx.post(f"{svc.url}/rl/v1/start_session", json={},
                       headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
        assert r.status_code == 429, r.text
        assert "warming up" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
        assert svc.stop(timeout_s=240) == 0
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()


def read_jsonl_items() -> list[dict[str, Any]]:
    import json

    path = Path(__file__).resolve().parents[2] / "examples" / "math_agent" / "train.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
