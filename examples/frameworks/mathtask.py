"""The zoo's shared task: one arithmetic question, the calculator tools, and the reward.

The same task, tools and reward as `examples/math_agent` (questions from its `tasks.py`, reward as
its `check_answer`): every framework example imports the plain functions here and wraps them in
its own tool type. Nothing here imports relayrl or any agent framework.
"""

from __future__ import annotations

import re
from typing import Any

INSTRUCTIONS = ("You are a careful calculator. Use the add and multiply tools for every step, "
                "then answer with the final number only.")

TASK: dict[str, Any] = {
    "messages": [{"role": "user", "content": "What is 6 * 7? Use the add and multiply tools, "
                                             "then give the final number."}],
    "answer": "42",
}
"""One item in `examples/math_agent/math.jsonl`'s shape."""


def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


def service_root(base_url: str) -> str:
    """The service's root URL from a base URL given either way: OpenAI-style (`.../v1`, as the
    trainer passes a session's) or the root (Anthropic-style, what the Anthropic SDK takes)."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def question(task: dict[str, Any]) -> str:
    """The task's user message."""
    return str(task["messages"][-1]["content"])


def check_answer(text: str, answer: str) -> float:
    """1.0 if the last number in `text` equals `answer`, else 0.0."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", (text or "").replace(",", ""))
    return 1.0 if numbers and float(numbers[-1]) == float(answer) else 0.0


_NUMBERS = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"]}
TOOL_SCHEMAS: list[dict[str, Any]] = [
    {"name": "add", "description": "Add two numbers.", "parameters": _NUMBERS},
    {"name": "multiply", "description": "Multiply two numbers.", "parameters": _NUMBERS},
]
"""The two tools as JSON Schema, for clients that take schemas rather than functions."""

TOOLS = {"add": add, "multiply": multiply}


def call_tool(name: str, arguments: Any) -> str:
    """Run a tool the model asked for; a bad name or bad arguments become an error text for it."""
    fn = TOOLS.get(name)
    if fn is None:
        return f"error: no tool named {name!r}; use add or multiply"
    try:
        return str(fn(float(arguments["a"]), float(arguments["b"])))
    except (KeyError, TypeError, ValueError):
        return "error: pass two numbers, a and b"
