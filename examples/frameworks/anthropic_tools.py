"""The math agent as a hand-rolled tool loop on the `anthropic` SDK, every call streamed.

    python examples/frameworks/anthropic_tools.py

No relayrl import: `AsyncAnthropic` gets the gateway's base URL and the session key.
"""

from __future__ import annotations

from typing import Any

import anthropic
from mathtask import INSTRUCTIONS, TOOL_SCHEMAS, call_tool, check_answer, question, service_root

TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
         for t in TOOL_SCHEMAS]


async def run(task: dict[str, Any], *, base_url: str, api_key: str, max_tokens: int = 64,
              max_turns: int = 4, **extra: Any) -> float:
    """Answer the task's question; the reward is `check_answer` on the final text."""
    client = anthropic.AsyncAnthropic(base_url=service_root(base_url), api_key=api_key,
                                      max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": question(task)}]
    try:
        for _ in range(max_turns):
            async with client.messages.stream(model="default", max_tokens=max_tokens,
                                              system=INSTRUCTIONS, tools=TOOLS,
                                              messages=messages) as stream:
                async for _event in stream:
                    pass  # a real UI would show text deltas here
                reply = await stream.get_final_message()
            messages.append({"role": "assistant",
                             "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                text = "".join(b.text for b in reply.content if b.type == "text")
                return check_answer(text, task["answer"])
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": call_tool(u.name, u.input)}
                for u in uses]})
    finally:
        await client.close()
    return 0.0  # still calling tools after max_turns


if __name__ == "__main__":
    from harness import main

    main(run, __doc__.splitlines()[0])
