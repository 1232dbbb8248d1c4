"""Tools the reference rollout server executes, and the executor that runs a turn's calls."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from relayrl.remote_rollout.schemas import Message, ToolCall, ToolDefinition
from relayrl.remote_rollout.tools.calculator import Calculator, ToolExecutionError, format_number


class Toolbox(Protocol):
    """Anything with tool definitions and an async `call(name, args) -> text`."""

    def definitions(self) -> list[ToolDefinition]:
        """The tools' definitions."""
        ...

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """Run one tool."""
        ...


@dataclass(frozen=True)
class ToolResult:
    """One executed call: the tool message for the conversation, and whether it failed."""

    message: Message
    error: bool
    latency_s: float


async def execute_tool_calls(toolbox: Toolbox, calls: Sequence[ToolCall]) -> list[ToolResult]:
    """Run a turn's calls in parallel (`asyncio.gather`), results in call order.

    A `ToolExecutionError` (bad arguments, division by zero, unknown tool) becomes an
    `Error: ...` tool message, so the model can recover; any other exception propagates and
    fails the rollout.
    """
    return list(await asyncio.gather(*(_run_one(toolbox, c) for c in calls)))


async def _run_one(toolbox: Toolbox, call: ToolCall) -> ToolResult:
    start = time.perf_counter()
    error = False
    try:
        content = await toolbox.call(call.function.name, parse_arguments(call.function.arguments))
    except ToolExecutionError as e:
        content, error = f"Error: {e}", True
    message = Message(role="tool", content=content, tool_call_id=call.id, name=call.function.name)
    return ToolResult(message, error, time.perf_counter() - start)


def parse_arguments(arguments: str | dict[str, Any]) -> dict[str, Any]:
    """A call's arguments as an object (ToolExecutionError if they are not a JSON object)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except ValueError as e:
        raise ToolExecutionError(f"arguments are not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ToolExecutionError("arguments must be a JSON object")
    return value


__all__ = ["Calculator", "ToolExecutionError", "ToolResult", "Toolbox", "execute_tool_calls",
           "format_number", "parse_arguments"]
