"""CAMEL-AI's ChatAgent, unchanged, through the gateway: the proxy way and the direct way.

camel-ai pins pydantic<=2.12.0, older than relayrl's other dependencies, so it lives in its own
environment (`.venv-camel`, made by scripts/install_frameworks.sh with torch and relayrl in it
too) and the example runs there as a subprocess, as a user would run it.
"""

from __future__ import annotations

import os
import re
import subprocess

import httpx
import pytest

from tests.frameworks.conftest import EXAMPLES, ZooGateway, tool_result_reached_model
from tests.gateway.conftest import ADMIN
from tests.gateway.test_openai_chat import call

ROOT = EXAMPLES.parents[1]
PYTHON = ROOT / ".venv-camel" / "bin" / "python"
SUMMARY = re.compile(r"session (\S+): reward ([\d.]+), (\d+) recorded calls, (\d+) tokens")


def camel(*args: str, timeout_s: float = 300) -> re.Match[str]:
    """Run the CAMEL example in its environment; the summary line it printed."""
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: run scripts/install_frameworks.sh")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    proc = subprocess.run([str(PYTHON), str(EXAMPLES / "camel_agent.py"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = SUMMARY.search(proc.stdout)
    assert match, proc.stdout[-2000:]
    return match


def export(gw: ZooGateway, session_id: str) -> list[dict]:
    r = httpx.post(gw.url + "/export_trajectories",
                   json={"session_id": session_id, "style": "individual"},
                   headers={"authorization": f"Bearer {ADMIN}"}, timeout=60)
    r.raise_for_status()
    return r.json()["rows"]


def no_errors(gw: ZooGateway) -> None:
    errors = [s for s in gw.log.seen if s[2] >= 400]
    assert not errors, f"CAMEL's calls drew errors: {errors}"


def test_camel_proxy_way_calls_a_tool_and_answers(zoo_fake: ZooGateway) -> None:
    zoo_fake.script.replies += [call("multiply", a=6, b=7), "6 times 7 is 42."]
    found = camel("--gateway", zoo_fake.url, "--admin-key", ADMIN)
    no_errors(zoo_fake)
    assert float(found[2]) == 1.0
    assert tool_result_reached_model(zoo_fake)
    rows = export(zoo_fake, found[1])
    assert len(rows) == 2 and all(sum(r["loss_mask"]) > 0 for r in rows)


@pytest.mark.slow
def test_camel_proxy_way_on_the_real_model(zoo_real: ZooGateway) -> None:
    start = len(zoo_real.log.seen)
    found = camel("--gateway", zoo_real.url, "--admin-key", ADMIN, "--max-tokens", "24",
                  "--max-turns", "1")
    errors = [s for s in zoo_real.log.seen[start:] if s[2] >= 400]
    assert not errors, errors
    rows = export(zoo_real, found[1])
    assert rows and sum(sum(r["loss_mask"]) for r in rows) > 0


@pytest.mark.slow
def test_camel_direct_way_with_a_relayrl_client_on_the_real_model() -> None:
    # its own in-process gateway app over the default model: no HTTP server, no port
    found = camel("--direct", "--max-tokens", "24", "--max-turns", "1")
    assert int(found[3]) >= 1 and int(found[4]) > 0

