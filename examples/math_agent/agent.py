"""The math agent: an openai-agents `Agent` with `add` and `multiply` tools.

It is ordinary agent code: it takes an OpenAI-compatible `base_url` and `api_key` (from
`extra_kwargs`, or from the environment in subprocess mode) and returns a reward, 1.0 when the
last number of its final answer is the right one. Nothing here imports relayrl except the
reward wrapper, which keeps the (synchronous) grader off the event loop.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    ToolCallItem,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from relayrl.workflow import AsyncRewardWrapper

INSTRUCTIONS = ("You are a careful calculator. Use the add and multiply tools for every step, "
                "then answer with the final number only.")


@function_tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


@function_tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


def check_answer(text: str, answer: str) -> float:
    """1.0 if the last number in `text` equals `answer`, else 0.0."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return 1.0 if numbers and float(numbers[-1]) == float(answer) else 0.0


def operations(question: str) -> int:
    """How many `+` and `*` the question's expression (its text before the first `?`) holds."""
    return len(re.findall(r"[+*]", question.split("?", 1)[0]))


_TOOL_OF = {ast.Add: "add", ast.Mult: "multiply"}


def plan(question: str) -> list[str]:
    """The tools the question's expression needs, in the order it is evaluated ([] if unparsable)."""
    expression = question.split("?", 1)[0].removeprefix("What is").strip()
    try:
        tree = ast.parse(expression, mode="eval").body
    except SyntaxError:
        return []
    steps: list[str] = []

    def walk(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return True
        if (isinstance(node, ast.BinOp) and type(node.op) in _TOOL_OF
                and walk(node.left) and walk(node.right)):
            steps.append(_TOOL_OF[type(node.op)])
            return True
        return False

    return steps if walk(tree) else []


class MathAgent:
    """Solves one arithmetic question with tools; `run` returns its reward."""

    def __init__(self, model: str = "default", max_tokens: int = 96, max_turns: int = 6,
                 temperature: float = 1.0, unanswered_reward: float = 0.0,
                 call_bonus: float = 0.0, plan_bonus: float = 0.0) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.temperature = temperature
        # Set below 0, a group where some episodes loop on tool calls until max_turns and others
        # answer wrongly still says "answer"; at 0 it looks uniform and is set aside. Measured
        # with -0.5 over six runs it did not beat 0 (benchmarks/RESULTS.md): the main job keeps 0.
        self.unanswered_reward = unanswered_reward
        # Task-specific shaping, off by default: added when the episode made exactly one tool
        # call per operation of the question, right answer or not, so a group that fails alike
        # still says "one call for `a * b`, two for `(a + b) * c`" (benchmarks/RESULTS.md).
        self.call_bonus = call_bonus
        # Task-specific shaping, off by default: added when the tools called, in order, are the
        # question's plan (`(a + b) * c`: add, then multiply), right answer or not; unlike the
        # call count it does not pay `a * b * c` solved as multiply-then-add. Measured, it paid
        # the right tools with wrong numbers and lowered the lift (benchmarks/RESULTS.md).
        self.plan_bonus = plan_bonus
        self.reward = AsyncRewardWrapper(check_answer, timeout_s=5.0)

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        """Answer `data["messages"]`; the reward compares the answer with `data["answer"]`."""
        set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI
        client = AsyncOpenAI(
            base_url=extra_kwargs.get("base_url") or os.environ["OPENAI_BASE_URL"],
            api_key=extra_kwargs.get("api_key") or os.environ["OPENAI_API_KEY"],
            http_client=extra_kwargs.get("http_client"),
            max_retries=0,
        )
        agent = Agent(
            name="calculator",
            instructions=INSTRUCTIONS,
            tools=[add, multiply],
            model=OpenAIChatCompletionsModel(model=self.model, openai_client=client),
            model_settings=ModelSettings(max_tokens=self.max_tokens,
                                         temperature=self.temperature),
        )
        try:
            result = await Runner.run(agent, data["messages"], max_turns=self.max_turns)
        except (MaxTurnsExceeded, ModelBehaviorError):
            # the policy never answered, or called a tool that does not exist: a failed episode,
            # not a broken one
            return self.unanswered_reward
        finally:
            if extra_kwargs.get("http_client") is None:
                # ours to close: left to the garbage collector, its close would be scheduled on
                # an event loop that `asyncio.run` has already closed
                await client.close()
        reward = await self.reward(str(result.final_output), data["answer"])
        question = str(data["messages"][-1]["content"])
        if self.call_bonus:
            calls = sum(isinstance(item, ToolCallItem) for item in result.new_items)
            if calls == operations(question):
                reward += self.call_bonus
        if self.plan_bonus:
            called = [getattr(item.raw_item, "name", None) for item in result.new_items
                      if isinstance(item, ToolCallItem)]
            if called and called == plan(question):
                reward += self.plan_bonus
        return reward
