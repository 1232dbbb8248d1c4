"""The math agent on smolagents: a `ToolCallingAgent` over its `OpenAIServerModel`.

    python examples/frameworks/smolagents_agent.py

No relayrl import: `OpenAIServerModel` gets the gateway's base URL and the session key. smolagents
is synchronous, so the agent runs in a worker thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

import mathtask
from mathtask import INSTRUCTIONS, check_answer, question, service_root
from smolagents import OpenAIServerModel, ToolCallingAgent, tool


@tool
def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return mathtask.add(a, b)


@tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return mathtask.multiply(a, b)


def solve(task: dict[str, Any], base_url: str, api_key: str, max_tokens: int,
          max_turns: int) -> float:
    """The synchronous agent run."""
    model = OpenAIServerModel(model_id="default", api_base=service_root(base_url) + "/v1",
                              api_key=api_key,
                              client_kwargs={"max_retries": 0}, max_tokens=max_tokens)
    agent = ToolCallingAgent(tools=[add, multiply], model=model, max_steps=max_turns,
                             instructions=INSTRUCTIONS, verbosity_level=0)
    # Errors of the model's making (a bad tool call, no final answer) are logged into the
    # agent's memory and the run goes on; a failed model call raises AgentGenerationError.
    return check_answer(str(agent.run(question(task))), task["answer"])


async def run(task: dict[str, Any], *, base_url: str, api_key: str, max_tokens: int = 64,
              max_turns: int = 3, **extra: Any) -> float:
    """Answer the task's question; the reward is `check_answer` on the final answer."""
    return await asyncio.to_thread(solve, task, base_url, api_key, max_tokens, max_turns)


if __name__ == "__main__":
    from harness import main

    main(run, __doc__.splitlines()[0])
