"""`POST /rollout`: the request the trainer sends, and the response, metrics and status it gets.

Pydantic only. `max_turns` and `max_tokens_total` are advisory: a server may stop earlier.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relayrl.remote_rollout.schemas.constants import (
    MAX_MESSAGES,
    MAX_TOKENS_LIMIT,
    MAX_TURNS_LIMIT,
)
from relayrl.remote_rollout.schemas.messages import Message, ToolDefinition
from relayrl.remote_rollout.schemas.params import SamplingParams


class RolloutStatus(StrEnum):
    """How a rollout ended."""

    COMPLETED = "COMPLETED"
    ERROR = "ERROR"


FinishReason = Literal["stop", "max_turns", "max_tokens", "error"]


class RolloutRequest(BaseModel):
    """Body of `POST /rollout`."""

    model_config = ConfigDict(extra="forbid")

    rollout_id: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    server_url: str = Field(min_length=1)
    """The trainer's callback root; the server POSTs `{server_url}/v1/chat/completions`."""
    callback_api_key: str | None = None
    """Sent as `Authorization: Bearer ...` on every callback (a session key in relayrl)."""
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    max_turns: int = Field(default=10, ge=1, le=MAX_TURNS_LIMIT)
    max_tokens_total: int = Field(default=8192, ge=1, le=MAX_TOKENS_LIMIT)
    tokenizer_name: str | None = None
    """The tokenizer (and chat template) the server renders with; the server's default if None."""
    tools: list[ToolDefinition] | None = None
    """Tools to offer the model; the server's own tools when None."""
    metadata: dict[str, Any] = Field(default_factory=dict)


class RolloutMetrics(BaseModel):
    """What a rollout cost."""

    model_config = ConfigDict(extra="allow")

    total_latency_ms: float = 0.0
    llm_latency_ms: float = 0.0
    tool_latency_ms: float = 0.0
    num_llm_calls: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of the last LLM call (the whole trajectory up to it)."""
    completion_tokens: int = 0
    """Tokens sampled over all LLM calls."""


class RolloutResponse(BaseModel):
    """Body of the answer to `POST /rollout`."""

    model_config = ConfigDict(extra="allow")

    rollout_id: str
    status: RolloutStatus
    final_messages: list[Message] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    error_message: str | None = None
    metrics: RolloutMetrics = Field(default_factory=RolloutMetrics)
    metadata: dict[str, Any] = Field(default_factory=dict)


__all__ = ["FinishReason", "RolloutMetrics", "RolloutRequest", "RolloutResponse",
           "RolloutStatus"]
