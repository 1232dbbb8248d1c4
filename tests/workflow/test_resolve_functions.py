"""A plain `run` function as a workflow: `workflow: module.run` with `workflow_kwargs`."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from relayrl.client.session_client import SessionClient
from relayrl.errors import ConfigError
from relayrl.workflow import AgentConfig, AgentWorkflow, resolve_workflow
from relayrl.workflow.agent import FunctionAgent

GATEWAY = SessionClient("http://127.0.0.1:9", admin_key="k")


async def answer(data: dict[str, Any], *, base_url: str, api_key: str, temperature: float = 1.0,
                 **extra: Any) -> float:
    """An agent as one async function."""
    return temperature


def sync_answer(data: dict[str, Any], **extra: Any) -> float:
    """An agent as one plain function (subprocess mode)."""
    return 1.0


async def test_a_function_becomes_an_agent_with_the_kwargs_bound() -> None:
    wf = resolve_workflow(f"{__name__}.answer", {"temperature": 0.25}, gateway=GATEWAY)
    assert isinstance(wf, AgentWorkflow) and isinstance(wf.agent, FunctionAgent)
    assert await wf.agent.run({}, base_url="u", api_key="k", http_client=None) == 0.25
    wf = resolve_workflow(answer, gateway=GATEWAY)
    assert wf.agent.run is answer


def test_a_plain_function_needs_subprocess_mode_and_pickles_by_reference() -> None:
    with pytest.raises(ConfigError, match="mode='subprocess'"):
        resolve_workflow(sync_answer, gateway=GATEWAY)
    wf = resolve_workflow(sync_answer, {"x": 1}, gateway=GATEWAY,
                          agent_config=AgentConfig(mode="subprocess"))
    assert isinstance(wf, AgentWorkflow)
    again = pickle.loads(pickle.dumps(wf.agent))
    assert again.fn is sync_answer and again.run({}) == 1.0


def test_a_function_without_a_gateway_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="needs a gateway"):
        resolve_workflow(answer)
