"""The math agent with the OpenAI Agents SDK over the Responses API (`OpenAIResponsesModel`).

    python examples/frameworks/openai_agents_responses.py

The math agent, unchanged except for its model class: the chat-completions version is
`examples/math_agent/agent.py`. No relayrl import: only a base URL and a key.
"""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from mathtask import INSTRUCTIONS, add, check_answer, multiply, question, service_root
from openai import AsyncOpenAI


async def run(task: dict[str, Any], *, base_url: str, api_key: str, max_tokens: int = 64,
              max_turns: int = 4, **extra: Any) -> float:
    """Answer the task's question; the reward is `check_answer` on the final output."""
    set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI
    client = AsyncOpenAI(base_url=service_root(base_url) + "/v1", api_key=api_key, max_retries=0)
    agent = Agent(name="calculator", instructions=INSTRUCTIONS,
                  tools=[function_tool(add), function_tool(multiply)],
                  model=OpenAIResponsesModel(model="default", openai_client=client),
                  model_settings=ModelSettings(max_tokens=max_tokens))
    try:
        result = await Runner.run(agent, question(task), max_turns=max_turns)
    except (MaxTurnsExceeded, ModelBehaviorError):
        return 0.0  # the policy never answered, or called a tool that does not exist
    finally:
        await client.close()
    return check_answer(str(result.final_output), task["answer"])


if __name__ == "__main__":
    from harness import main

    main(run, __doc__.splitlines()[0])
