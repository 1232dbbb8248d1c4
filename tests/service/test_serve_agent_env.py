"""What `relayrl serve` prints for agents is exactly what they need: a real service on loopback,
the printed lines pasted into bash, then the service document's phase-1 agent (the manual
trajectory example, run under `AgentSession`) in that shell. Its sessions are finalized and
trained, and the generated key is never printed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from relayrl.service.launcher import agent_env_lines
from tests.service.test_serve import Service, _config, _free_port
from tests.train.conftest import tiny_llama_dir  # noqa: F401 - a fixture used below

# The phase-1 agent of the any-agent service document ("Manual Trajectory Management"), with
# relayrl's import for AgentSession; `dataset` and the epoch count are the test's. The service
# address and key come from the environment the printed lines set.
AGENT = '''
import os
import asyncio
from aiohttp import ClientSession

class MyAgent:
    async def run(self, prompt):
        url = os.environ['OPENAI_BASE_URL']
        async with ClientSession(base_url=url) as session:
            response = await session.post("/v1/chat/completions", json={
                "model": "gpt-3.5-turbo",
                "messages": [{"role": "user", "content": prompt}]
            })
            completion_data = await response.json()
            await session.post("/rl/v1/set_reward", json={
                "completion_id": completion_data["id"],
                "reward": 0.5
            })
            await session.post("/rl/v1/finalize", json={
                "final_reward": 1.0
            })

from relayrl.client import AgentSession

dataset = ["What is 2 + 2?", "Name a prime number."]

async def run_training():
    for epoch in range(2):
        for prompt in dataset:
            async with AgentSession():
                await MyAgent().run(prompt)

if __name__ == "__main__":
    asyncio.run(run_training())
    print("agent done")
'''


def test_lines_read_the_key_file_and_never_hold_the_key(tmp_path: Path) -> None:
    key_file = tmp_path / "run dir" / "admin_key"
    key_file.parent.mkdir()
    key_file.write_text("s3cret-key-value-0123456789abcdef\n")
    lines = agent_env_lines("http://127.0.0.1:8765", key_file)
    assert not any("s3cret" in line for line in lines)
    out = subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(lines) + "\n"
                          'printf "%s|%s|%s|%s" "$OPENAI_BASE_URL" "$OPENAI_API_KEY" '
                          '"$RELAYRL_URL" "$RELAYRL_API_KEY"'],
                         env={"PATH": "/usr/bin:/bin", "RELAYRL_URL": "http://elsewhere:1"},
                         capture_output=True, text=True, timeout=30, check=True).stdout
    key = "s3cret-key-value-0123456789abcdef"
    assert out == f"http://127.0.0.1:8765|{key}|http://127.0.0.1:8765|{key}"
    configured = agent_env_lines("http://127.0.0.1:8765", None)
    url = "http://127.0.0.1:8765"
    assert configured[0] == f"export OPENAI_BASE_URL={url} RELAYRL_URL={url}"
    assert "API_KEY=" not in "".join(configured)


@pytest.mark.slow
def test_the_printed_lines_are_all_a_phase_1_agent_needs(tmp_path: Path,
                                                         tiny_llama_dir: str) -> None:  # noqa: F811
    port = _free_port()
    config = _config(tmp_path, tiny_llama_dir, port, rollout={"group_size": 2, "batch_size": 1})
    cfg = yaml.safe_load(config.read_text())
    del cfg["gateway"]["admin_key"]  # no key in the config: the service generates one
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "serve.log"
    svc = Service(config, port, log)
    try:
        deadline = time.monotonic() + 30
        while "OPENAI_API_KEY" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        lines = [ln for ln in log.read_text().splitlines() if ln.startswith("export ")]
        assert len(lines) == 2 and "OPENAI_BASE_URL" in lines[0], log.read_text()[-2000:]
        (tmp_path / "agent.py").write_text(AGENT)
        # only what the printed lines set points the agent anywhere: a stale service address
        # and key in the shell do not count
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
               "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
               "RELAYRL_URL": "http://127.0.0.1:9", "RELAYRL_API_KEY": "stale-key"}
        pasted = "\n".join(lines)
        script = f"set -euo pipefail\n{pasted}\nexec {sys.executable} agent.py\n"
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "agent done" in done.stdout
        svc.wait_for(lambda s: s["trainer"]["trajectories_trained"] >= 4
                     and s["trainer"]["step"] >= 2, "the agent's four trajectories trained")
        assert svc.stop() == 0
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()
    key = (tmp_path / "runs" / "svc" / "t" / "admin_key").read_text().strip()
    assert len(key) >= 32 and key not in log.read_text()  # pointed at, never printed
