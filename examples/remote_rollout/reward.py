"""The math task's reward over a remote rollout: the last assistant message's last number."""

from __future__ import annotations

import re
from typing import Any


def math_reward(final_messages: list[dict[str, Any]], data: dict[str, Any]) -> float:
    """1.0 if the last number of the final assistant message equals `data["answer"]`, else 0.0."""
    last = next((m for m in reversed(final_messages) if m.get("role") == "assistant"), None)
    text = (last or {}).get("content") or ""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return 1.0 if numbers and float(numbers[-1]) == float(data["answer"]) else 0.0
