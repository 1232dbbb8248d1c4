"""The calculator tools of the reference server: add, subtract, multiply, divide.

Each call waits a random 10-100 ms first, as a real tool's latency would (seedable; a range of
(0, 0) turns the wait off for fast tests). Bad arguments and division by zero raise
`ToolExecutionError` with a message the model can read. Imports only the standard library and
this package's schemas.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any

from relayrl.remote_rollout.schemas import FunctionDefinition, ToolDefinition


class ToolExecutionError(Exception):
    """A tool refused its arguments or failed in an expected way; the model is told why."""


Number = int | float
ToolFn = Callable[[dict[str, Any]], Awaitable[str]]


def _definition(name: str, description: str) -> ToolDefinition:
    return ToolDefinition(function=FunctionDefinition(
        name=name, description=description,
        parameters={"type": "object",
                    "properties": {"a": {"type": "number", "description": "first operand"},
                                   "b": {"type": "number", "description": "second operand"}},
                    "required": ["a", "b"]}))


def _divide(a: Number, b: Number) -> Number:
    if b == 0:
        raise ToolExecutionError("division by zero: b must not be 0")
    return a / b


_OPS: dict[str, tuple[str, Callable[[Number, Number], Number]]] = {
    "add": ("Add two numbers: a + b.", lambda a, b: a + b),
    "subtract": ("Subtract b from a: a - b.", lambda a, b: a - b),
    "multiply": ("Multiply two numbers: a * b.", lambda a, b: a * b),
    "divide": ("Divide a by b: a / b (b must not be 0).", _divide),
}


def _number(args: dict[str, Any], key: str, tool: str) -> Number:
    v = args.get(key)
    if isinstance(v, str):  # small models quote numbers; accept what parses
        with contextlib.suppress(ValueError):
            v = float(v) if any(c in v for c in ".eE") else int(v)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ToolExecutionError(f"{tool} needs a number for {key!r}, got {args.get(key)!r}")
    return v


def format_number(x: Number) -> str:
    """A result as the model should read it: integers without a trailing `.0`."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x) if isinstance(x, float) else str(x)


class Calculator:
    """The four tools, with a random delay per call drawn from `delay_s` (seeded by `seed`)."""

    def __init__(self, delay_s: tuple[float, float] = (0.01, 0.1), seed: int | None = None) -> None:
        lo, hi = delay_s
        if lo < 0 or hi < lo:
            raise ValueError(f"tool delay range must satisfy 0 <= min <= max, got {delay_s}")
        self.delay_s = (lo, hi)
        self._rng = random.Random(seed)

    def definitions(self) -> list[ToolDefinition]:
        """The tools' definitions (what `GET /tools` lists)."""
        return [_definition(name, desc) for name, (desc, _) in _OPS.items()]

    def names(self) -> list[str]:
        """The tools' names."""
        return list(_OPS)

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """Run tool `name` on `args`; its result as text (ToolExecutionError on bad input)."""
        op = _OPS.get(name)
        if op is None:
            raise ToolExecutionError(f"unknown tool {name!r}; the tools are {', '.join(_OPS)}")
        lo, hi = self.delay_s
        if hi > 0:
            await asyncio.sleep(self._rng.uniform(lo, hi))
        a, b = _number(args, "a", name), _number(args, "b", name)
        return format_number(op[1](a, b))


__all__ = ["Calculator", "ToolExecutionError", "format_number"]
