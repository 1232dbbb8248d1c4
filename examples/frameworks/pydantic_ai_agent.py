"""The math agent on pydantic-ai: an `Agent` over `OpenAIChatModel` with two plain tools.

    python examples/frameworks/pydantic_ai_agent.py

No relayrl import: the `OpenAIProvider` gets the gateway's base URL and the session key.
"""

from __future__ import annotations

from typing import Any

from mathtask import INSTRUCTIONS, add, check_answer, multiply, question, service_root
from pydantic_ai import Agent
from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits


async def run(task: dict[str, Any], *, base_url: str, api_key: str, max_tokens: int = 64,
              max_turns: int = 4, **extra: Any) -> float:
    """Answer the task's question; the reward is `check_answer` on the output."""
    provider = OpenAIProvider(base_url=service_root(base_url) + "/v1", api_key=api_key)
    model = OpenAIChatModel("default", provider=provider)
    agent = Agent(model, instructions=INSTRUCTIONS, tools=[add, multiply], retries=1)
    try:
        result = await agent.run(question(task), model_settings={"max_tokens": max_tokens},
                                 usage_limits=UsageLimits(request_limit=max_turns))
    except (UnexpectedModelBehavior, UsageLimitExceeded):
        return 0.0  # malformed tool calls past the retries, or no answer within the limit
    return check_answer(str(result.output), task["answer"])


if __name__ == "__main__":
    from harness import main

    main(run, __doc__.splitlines()[0])
