"""Every zoo example's `run`, handed to the trainer as a workflow (`workflow: MODULE.run`).

The trainer's own machinery runs it: `resolve_workflow` on the dotted path with
`workflow_kwargs`, an `AgentWorkflow` that calls `run(data, base_url=<session's .../v1 URL>,
api_key=<session key>, http_client=<its shared client>, **workflow_kwargs)`, and a
`RolloutController` that turns the episode into a training batch. A scripted engine walks the
tool path to the right answer (the wiring is what is tested); the framework packages are the
real ones.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from mathtask import TASK

from tests.frameworks.as_workflow import one_batch
from tests.frameworks.conftest import EXAMPLES, ZooGateway, tool_result_reached_model
from tests.frameworks.test_zoo import ZOO
from tests.gateway.conftest import ADMIN
from tests.gateway.test_openai_chat import call

ROOT = EXAMPLES.parents[1]
CAMEL_PYTHON = ROOT / ".venv-camel" / "bin" / "python"
EXAMPLE_ZOO = [f for f in ZOO if f.module != "math_agent"]  # math_agent has its own class


def _check(result: dict, gw: ZooGateway) -> None:
    assert result["workflow"] == "AgentWorkflow", result
    assert result["batches"] == 1 and result["aborted"] == 0, result
    assert result["rewards"] and result["rewards"][-1] == 1.0, result
    assert sum(result["trained_tokens"]) > 0, result
    assert tool_result_reached_model(gw)
    errors = [s for s in gw.log.seen if s[2] >= 400]
    assert not errors, f"the framework's calls drew errors: {errors}"
    assert any(s[1].startswith("/s/") for s in gw.log.seen), "no call used the session's URL"


@pytest.mark.parametrize("framework", EXAMPLE_ZOO, ids=[f.module for f in EXAMPLE_ZOO])
async def test_the_examples_run_is_a_workflow(framework, zoo_fake: ZooGateway) -> None:
    zoo_fake.script.replies += list(framework.replies)
    result = await one_batch(framework.module, zoo_fake.url, ADMIN, TASK)
    _check(result, zoo_fake)


def test_camels_run_is_a_workflow(zoo_fake: ZooGateway) -> None:
    if not CAMEL_PYTHON.exists():
        pytest.fail(f"{CAMEL_PYTHON} is missing: run scripts/install_frameworks.sh")
    zoo_fake.script.replies += [call("multiply", a=6, b=7), "6 times 7 is 42."]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    proc = subprocess.run([str(CAMEL_PYTHON), str(ROOT / "tests" / "frameworks" / "as_workflow.py"),
                           "camel_agent", zoo_fake.url, ADMIN], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads(proc.stdout.strip().splitlines()[-1]), zoo_fake)
