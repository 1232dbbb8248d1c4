"""AReaL's CAMEL `RolloutWorkflow`: a ChatAgent on a DirectClient made from the engine inside
`arun_episode`, plain `set_last_reward`, discount, export returned to the episode runner. CAMEL
runs in its own environment (see test_camel.py), against a scripted gateway on loopback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.frameworks.conftest import EXAMPLES, ZooGateway
from tests.gateway.conftest import ADMIN

ROOT = EXAMPLES.parents[1]
PYTHON = ROOT / ".venv-camel" / "bin" / "python"
SCRIPT = Path(__file__).resolve().parent / "camel_workflow.py"


def test_the_seeds_camel_workflow_records_its_calls_and_reward(zoo_fake: ZooGateway) -> None:
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: run scripts/install_frameworks.sh")
    assert zoo_fake.script is not None
    zoo_fake.script.replies.append("4")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(EXAMPLES), str(ROOT)]))
    proc = subprocess.run([str(PYTHON), str(SCRIPT), zoo_fake.url, ADMIN], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome["status"] == "finished", outcome["error"]
    assert outcome["rewards"] == [1.0]  # the plain set_last_reward reached the row
    assert outcome["trained"] > 0
    assert not [s for s in zoo_fake.log.seen if s[2] >= 400]
