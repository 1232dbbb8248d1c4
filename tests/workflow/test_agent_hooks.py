"""An agent's optional hooks: its counters reach the step metrics, its aclose runs at the end."""

from __future__ import annotations

from typing import Any

from relayrl.client.session_client import SessionClient
from relayrl.workflow import AgentWorkflow, resolve_workflow


class CountingAgent:
    """Keeps a counter and holds something to release."""

    def __init__(self) -> None:
        self.closed = 0

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        return 1.0

    def counters(self) -> dict[str, float]:
        return {"questions": 3.0}

    async def aclose(self) -> None:
        self.closed += 1


class PlainAgent:
    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        return 0.0


async def test_an_agents_counters_and_aclose_are_the_workflows() -> None:
    async with SessionClient("http://127.0.0.1:9", "unused") as client:
        agent = CountingAgent()
        workflow = resolve_workflow(agent, group_size=2, gateway=client)
        assert workflow.counters() == {"questions": 3.0}  # through the group wrapper too
        await workflow.aclose()
        inner = AgentWorkflow(agent, client)
        await inner.aclose()
        assert agent.closed == 2
        plain = AgentWorkflow(PlainAgent(), client)
        assert plain.counters() == {}
        await plain.aclose()
