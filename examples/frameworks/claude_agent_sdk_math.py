"""The math agent on the Claude Agent SDK: the Claude Code CLI, pointed at the gateway.

    python examples/frameworks/claude_agent_sdk_math.py

`claude-agent-sdk` runs the Claude Code CLI (its wheel bundles the binary) and talks to it over
stdio; the CLI sends streamed `POST /v1/messages?beta=true` calls with tools to
`ANTHROPIC_BASE_URL`. The calculator tools are an in-process SDK MCP server. The system prompt
replaces Claude Code's own and the built-in tools are switched off, because Claude Code's default
prompt and tool list (about 20k tokens) do not fit a small model's context. No relayrl import.
"""

from __future__ import annotations

import os
from contextlib import aclosing
from typing import Any

from claude_agent_sdk import (
    AssistantMessage,
    ClaudeAgentOptions,
    ResultMessage,
    TextBlock,
    create_sdk_mcp_server,
    query,
    tool,
)
from mathtask import INSTRUCTIONS, check_answer, question, service_root
from mathtask import add as add_numbers
from mathtask import multiply as multiply_numbers

NUMBERS = {"a": float, "b": float}


@tool("add", "Add two numbers.", NUMBERS)
async def add(args: dict[str, Any]) -> dict[str, Any]:
    """The add tool, as an MCP tool result."""
    return {"content": [{"type": "text", "text": str(add_numbers(args["a"], args["b"]))}]}


@tool("multiply", "Multiply two numbers.", NUMBERS)
async def multiply(args: dict[str, Any]) -> dict[str, Any]:
    """The multiply tool, as an MCP tool result."""
    return {"content": [{"type": "text", "text": str(multiply_numbers(args["a"], args["b"]))}]}


class ClaudeApiError(RuntimeError):
    """The CLI reported that a model call failed (an HTTP error from the endpoint)."""


async def run(task: dict[str, Any], *, base_url: str, api_key: str, max_tokens: int = 64,
              max_turns: int = 4, **extra: Any) -> float:
    """Answer the task's question; the reward is `check_answer` on the final result."""
    options = ClaudeAgentOptions(
        system_prompt=INSTRUCTIONS,
        tools=[],  # no built-in tools (Bash, Read, ...): only the calculator
        mcp_servers={"calc": create_sdk_mcp_server("calc", tools=[add, multiply])},
        allowed_tools=["mcp__calc__add", "mcp__calc__multiply"],
        strict_mcp_config=True,
        setting_sources=[],  # ignore the user's and the project's Claude settings
        model="default",
        max_turns=max_turns,
        env={"ANTHROPIC_BASE_URL": service_root(base_url), "ANTHROPIC_API_KEY": api_key,
             "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_tokens),
             "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
             "HOME": os.environ.get("HOME", "/tmp")},
    )
    text = ""
    # aclosing: leaving the loop early must still stop the CLI process now, on this event loop
    async with aclosing(query(prompt=question(task), options=options)) as messages:
        async for message in messages:
            if isinstance(message, AssistantMessage):
                text = "".join(b.text for b in message.content
                               if isinstance(b, TextBlock)) or text
            elif isinstance(message, ResultMessage):
                if message.api_error_status is not None:
                    raise ClaudeApiError(f"{message.api_error_status}: {message.result}")
                if message.is_error:
                    # e.g. error_max_turns, or a reply cut at max_tokens (the CLI calls that an
                    # error): the policy's doing, a wrong answer
                    return 0.0
                text = message.result or text
    return check_answer(text, task["answer"])


if __name__ == "__main__":
    from harness import main

    main(run, __doc__.splitlines()[0])
