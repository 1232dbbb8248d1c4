"""Every framework of the zoo (examples/frameworks), unchanged, through a real gateway.

Per framework: a scripted FakeEngine run that takes the tool path (the 135M model seldom writes a
valid tool call) and checks the tool's result reached the model, and a run on the real default
model. Both fail on any 4xx/5xx the framework's calls drew, and both need the exported session to
hold the model's tokens under the loss mask. A wrong answer from the real model is fine.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from mathtask import TASK

from tests.frameworks.conftest import (
    EXAMPLES,
    ZooGateway,
    assert_trainable,
    tool_result_reached_model,
)
from tests.gateway.test_openai_chat import call


@dataclass(frozen=True)
class Framework:
    """An example module and the scripted replies that walk its tool path to a right answer."""

    module: str
    replies: tuple[str, ...]

    def run(self) -> Callable[..., Awaitable[float]]:
        """The example's `run(task, *, base_url, api_key, max_tokens, max_turns, **extra)`."""
        if self.module == "math_agent":
            return math_agent_run
        return importlib.import_module(self.module).run


async def math_agent_run(task: dict[str, Any], *, base_url: str, api_key: str,
                         max_tokens: int = 64, max_turns: int = 4, **extra: Any) -> float:
    """examples/math_agent's MathAgent (openai-agents over Chat Completions), as it is."""
    spec = importlib.util.spec_from_file_location("zoo_math_agent", MATH_AGENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    agent = module.MathAgent(max_tokens=max_tokens, max_turns=max_turns)
    return await agent.run(task, base_url=base_url, api_key=api_key, **extra)


ANSWER = "6 times 7 is 42."
TOOL_THEN_ANSWER = (call("multiply", a=6, b=7), ANSWER)
ZOO = [
    Framework("math_agent", TOOL_THEN_ANSWER),
    Framework("openai_agents_responses", TOOL_THEN_ANSWER),
    Framework("langgraph_react", TOOL_THEN_ANSWER),
    Framework("anthropic_tools", TOOL_THEN_ANSWER),
    Framework("claude_agent_sdk_math", (call("mcp__calc__multiply", a=6, b=7), ANSWER)),
    Framework("pydantic_ai_agent", TOOL_THEN_ANSWER),
    # a ToolCallingAgent answers through its own final_answer tool
    Framework("smolagents_agent", (call("multiply", a=6, b=7),
                                   '<tool_call>\n{"name": "final_answer", '
                                   '"arguments": {"answer": "42"}}\n</tool_call>')),
    Framework("litellm_agent", TOOL_THEN_ANSWER),
    Framework("aiohttp_agent", TOOL_THEN_ANSWER),
]
IDS = [f.module for f in ZOO]
MATH_AGENT = EXAMPLES.parent / "math_agent" / "agent.py"


@pytest.mark.parametrize("framework", ZOO, ids=IDS)
async def test_the_agent_calls_a_tool_and_its_answer_is_rewarded(framework: Framework,
                                                                 zoo_fake: ZooGateway) -> None:
    run = framework.run()
    zoo_fake.script.replies += list(framework.replies)
    ep = await zoo_fake.episode(run, task=TASK)
    assert ep.reward == 1.0
    assert tool_result_reached_model(zoo_fake)
    assert len(ep.rows) == len(zoo_fake.script.requests)  # every call recorded, one row each
    assert_trainable(ep)


@pytest.mark.slow
@pytest.mark.parametrize("framework", ZOO, ids=IDS)
async def test_the_agent_runs_on_the_real_model(framework: Framework,
                                                zoo_real: ZooGateway) -> None:
    run = framework.run()
    # one short turn keeps the suite quick (the scripted test walks the multi-turn path); a
    # truncated or wrong answer is still a valid episode
    ep = await zoo_real.episode(run, task=TASK, max_tokens=24, max_turns=1)
    assert ep.reward in (0.0, 1.0)
    assert_trainable(ep)
