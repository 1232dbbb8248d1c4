"""Every framework of the zoo (examples/frameworks), unchanged, through a real gateway.

Per framework: a scripted FakeEngine run that takes the tool path (the 135M model seldom writes a
valid tool call) and checks the tool's result reached the model, and a run on the real default
model. Both fail on any 4xx/5xx the framework's calls drew, and both need the exported session to
hold the model's tokens under the loss mask. A wrong answer from the real model is fine.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import pytest
from mathtask import TASK

from tests.frameworks.conftest import ZooGateway, assert_trainable, tool_result_reached_model
from tests.gateway.test_openai_chat import call


@dataclass(frozen=True)
class Framework:
    """An example module and the scripted replies that walk its tool path to a right answer."""

    module: str
    replies: tuple[str, ...]


ANSWER = "6 times 7 is 42."
TOOL_THEN_ANSWER = (call("multiply", a=6, b=7), ANSWER)
ZOO = [
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


@pytest.mark.parametrize("framework", ZOO, ids=IDS)
async def test_the_agent_calls_a_tool_and_its_answer_is_rewarded(framework: Framework,
                                                                 zoo_fake: ZooGateway) -> None:
    run = importlib.import_module(framework.module).run
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
    run = importlib.import_module(framework.module).run
    # short calls keep the suite quick; a truncated or wrong answer is still a valid episode
    ep = await zoo_real.episode(run, task=TASK, max_tokens=24, max_turns=2)
    assert ep.reward in (0.0, 1.0)
    assert_trainable(ep)
