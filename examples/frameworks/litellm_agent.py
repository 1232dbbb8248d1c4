"""The math agent as a tool loop on litellm: `litellm.acompletion(..., api_base=...)`.

    python examples/frameworks/litellm_agent.py

The `openai/` model prefix makes litellm speak OpenAI Chat Completions to `api_base`. No relayrl
import.
"""

from __future__ import annotations

import json
import os
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import

import litellm
from mathtask import INSTRUCTIONS, TOOL_SCHEMAS, call_tool, check_answer, question, service_root

TOOLS = [{"type": "function", "function": t} for t in TOOL_SCHEMAS]


async def run(task: dict[str, Any], *, base_url: str, api_key: str, max_tokens: int = 64,
              max_turns: int = 4, **extra: Any) -> float:
    """Answer the task's question; the reward is `check_answer` on the final text."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": question(task)}]
    for _ in range(max_turns):
        response = await litellm.acompletion(model="openai/default",
                                             api_base=service_root(base_url) + "/v1",
                                             api_key=api_key, messages=messages, tools=TOOLS,
                                             max_tokens=max_tokens, num_retries=0)
        message = response.choices[0].message
        calls = message.tool_calls or []
        messages.append(message.model_dump(exclude_none=True))
        if not calls:
            return check_answer(message.content or "", task["answer"])
        for c in calls:
            try:
                arguments = json.loads(c.function.arguments or "{}")
            except json.JSONDecodeError:
                arguments = {}
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": call_tool(c.function.name, arguments)})
    return 0.0  # still calling tools after max_turns


if __name__ == "__main__":
    from harness import main

    main(run, __doc__.splitlines()[0])
