"""The callback: what the rollout server sends to `/v1/chat/completions`, and what it reads back.

Pydantic only. The request is OpenAI's plus the protocol's `rollout_id` and `response_mask`
(0 for every token the server added since the previous call: tool outputs, templates' glue);
the response is OpenAI's plus `token_ids` (sampled) and `prompt_token_ids`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relayrl.remote_rollout.schemas.messages import Message, ToolDefinition


class CompletionsRequest(BaseModel):
    """Body of one callback."""

    model_config = ConfigDict(extra="allow")

    model: str = "default"
    messages: list[Message]
    rollout_id: str
    response_mask: list[int] | None = None
    """None on a rollout's first call; after that one 0 per token added since the last call."""
    tools: list[ToolDefinition] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    return_token_ids: bool = True


class CompletionsMessage(BaseModel):
    """The assistant message of a choice."""

    model_config = ConfigDict(extra="allow")

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class CompletionsChoice(BaseModel):
    """One choice of a callback's answer."""

    model_config = ConfigDict(extra="allow")

    index: int = 0
    message: CompletionsMessage
    finish_reason: str | None = None


class CompletionsResponse(BaseModel):
    """A callback's answer (only what the protocol needs is required)."""

    model_config = ConfigDict(extra="allow")

    id: str = ""
    choices: list[CompletionsChoice] = Field(min_length=1)
    token_ids: list[int]
    """The sampled tokens of the first choice, end-of-turn token included."""
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None


__all__ = ["CompletionsChoice", "CompletionsMessage", "CompletionsRequest", "CompletionsResponse"]
