"""The math agent in plain HTTP with aiohttp: Chat Completions JSON, a tool loop, no SDK.

    python examples/frameworks/aiohttp_agent.py

Any client that can POST JSON can be trained. No relayrl import.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from mathtask import INSTRUCTIONS, TOOL_SCHEMAS, call_tool, check_answer, question, service_root

TOOLS = [{"type": "function", "function": t} for t in TOOL_SCHEMAS]


async def run(task: dict[str, Any], *, base_url: str, api_key: str, max_tokens: int = 64,
              max_turns: int = 4, **extra: Any) -> float:
    """Answer the task's question; the reward is `check_answer` on the final text."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTIONS},
                                      {"role": "user", "content": question(task)}]
    headers = {"authorization": f"Bearer {api_key}"}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(base_url=service_root(base_url) + "/", headers=headers,
                                     timeout=timeout) as http:
        for _ in range(max_turns):
            async with http.post("v1/chat/completions", json={
                    "model": "default", "messages": messages, "tools": TOOLS,
                    "max_tokens": max_tokens}) as resp:
                resp.raise_for_status()  # a 4xx/5xx is a broken episode, not a wrong answer
                body = await resp.json()
            message = body["choices"][0]["message"]
            messages.append(message)
            calls = message.get("tool_calls") or []
            if not calls:
                return check_answer(message.get("content") or "", task["answer"])
            for c in calls:
                try:
                    arguments = json.loads(c["function"]["arguments"] or "{}")
                except json.JSONDecodeError:
                    arguments = {}
                messages.append({"role": "tool", "tool_call_id": c["id"],
                                 "content": call_tool(c["function"]["name"], arguments)})
    return 0.0  # still calling tools after max_turns


if __name__ == "__main__":
    from harness import main

    main(run, __doc__.splitlines()[0])
