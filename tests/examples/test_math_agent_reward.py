"""The math agent's reward through a real gateway: correct 1, wrong 0, never answered its own value.

The agent is the real MathAgent (openai-agents over HTTP); the engine is a FakeEngine scripted to
answer like the teacher, or to call a tool forever.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import pytest

from relayrl.client import SessionClient
from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.models import model_path
from relayrl.types import GenerateRequest
from relayrl.workflow import AgentWorkflow, EpisodeContext, episode_scope
from tests.examples import load_example

teacher = load_example("math_agent", "teacher")
agent_module = load_example("math_agent", "agent")
TASK = {"messages": [{"role": "user", "content": "What is 3 + 4? Use the add and multiply tools, "
                                                 "then give the final number."}], "answer": "7"}


async def _reward(model_dir: str, script: Callable[[GenerateRequest], str],
                  **agent_kwargs: float) -> float:
    path = model_path(model_dir)
    engine = FakeEngine(script, tokenizer_path=path)
    key = secrets.token_hex(16)
    config = GatewayConfig(model=path, engine="fake", admin_key=key, model_label="m",
                           batch_size=1, max_staleness=0)
    agent = agent_module.MathAgent(model="m", max_turns=3, **agent_kwargs)
    with GatewayThread(build_deps(config, engine=engine)) as gateway:
        async with SessionClient(gateway.url, key) as client:
            workflow = AgentWorkflow(agent, client)
            try:
                with episode_scope(EpisodeContext(task_id="t", episode_id="e")):
                    rows = await workflow.arun_episode(engine, TASK)
            finally:
                await workflow.aclose()
    (row,) = (rows or {}).values()
    return row.reward


def _looping(request: GenerateRequest) -> str:
    return teacher.tool_call_text("add", {"a": 3, "b": 4})


@pytest.mark.parametrize("unanswered", [0.0, -0.5])
async def test_an_episode_that_never_answers_gets_the_unanswered_reward(
    model_dir: str, unanswered: float
) -> None:
    assert await _reward(model_dir, _looping, unanswered_reward=unanswered) == unanswered


async def test_right_and_wrong_answers_keep_one_and_zero(model_dir: str) -> None:
    right = teacher.teacher_script(model_dir)
    assert await _reward(model_dir, right, unanswered_reward=-0.5) == 1.0
    assert await _reward(model_dir, lambda r: "The answer is 8.", unanswered_reward=-0.5) == 0.0


def test_operations_counts_the_expression_only() -> None:
    assert agent_module.operations(TASK["messages"][0]["content"]) == 1
    assert agent_module.operations("What is (2 + 3) * 4? Use add and multiply.") == 2
    assert agent_module.operations("What is 2 * 3 * 4 + 1? then + more") == 3


async def test_the_call_bonus_goes_to_one_call_per_operation_only(model_dir: str) -> None:
    right = teacher.teacher_script(model_dir)
    assert await _reward(model_dir, right, call_bonus=0.25) == 1.25
    assert await _reward(model_dir, right) == 1.0  # off by default

    decode = teacher._decode_fn(model_dir)

    def twice(request: GenerateRequest) -> str:
        # right, but with a redundant second call: add(3, 4), then add(7, 0), then the answer
        done = len(teacher.TOOL_RESPONSE.findall(decode(list(request.prompt_ids))))
        if done < 2:
            return teacher.tool_call_text("add", {"a": 7 if done else 3, "b": 0 if done else 4})
        return teacher.answer_text(7.0)

    assert await _reward(model_dir, twice, call_bonus=0.25) == 1.0
    assert await _reward(model_dir, lambda r: "The answer is 8.", call_bonus=0.25) == 0.0


def test_plan_follows_evaluation_order() -> None:
    assert agent_module.plan(TASK["messages"][0]["content"]) == ["add"]
    assert agent_module.plan("What is (2 + 3) * 4? Use add and multiply.") == ["add", "multiply"]
    assert agent_module.plan("What is 2 * 3 + 4? x") == ["multiply", "add"]
    assert agent_module.plan("What is 2 + 3 * 4? x") == ["multiply", "add"]
    assert agent_module.plan("What is 2 * 3 * 4? x") == ["multiply", "multiply"]
    assert agent_module.plan("What is 2 - 3? x") == []
    assert agent_module.plan("What is the time? x") == []


async def test_the_plan_bonus_goes_to_the_plan_s_tools_in_order_only(model_dir: str) -> None:
    right = teacher.teacher_script(model_dir)
    assert await _reward(model_dir, right, plan_bonus=0.25) == 1.25
    assert await _reward(model_dir, right) == 1.0  # off by default

    decode = teacher._decode_fn(model_dir)

    def one_call(tool: str, answer: float) -> Callable[[GenerateRequest], str]:
        """A script that calls `tool` on 3 and 4 once, then answers `answer`."""
        def script(request: GenerateRequest) -> str:
            if teacher.TOOL_RESPONSE.findall(decode(list(request.prompt_ids))):
                return teacher.answer_text(answer)
            return teacher.tool_call_text(tool, {"a": 3, "b": 4})
        return script

    # the right number after the wrong tool: 1, no bonus; the right tool, a wrong number: the bonus
    assert await _reward(model_dir, one_call("multiply", 7.0), plan_bonus=0.25) == 1.0
    assert await _reward(model_dir, one_call("add", 8.0), plan_bonus=0.25) == 0.25
    assert await _reward(model_dir, lambda r: "The answer is 8.", plan_bonus=0.25) == 0.0
