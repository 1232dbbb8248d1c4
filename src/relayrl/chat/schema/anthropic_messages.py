"""Request schema of Anthropic Messages (`POST /v1/messages`).

Fields follow the order of Anthropic's API reference (`model`, `messages`, `max_tokens`, then
alphabetical); fields the current `anthropic` SDK no longer lists but clients still send
(`temperature`, `top_p`, `top_k`) are kept and marked. Content blocks are a union picked by `type`;
any block type we do not serve parses as `OtherBlock`, so the converter can refuse it by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictFloat, StrictInt, Tag

from relayrl.chat.schema import WireModel


class TextBlock(WireModel):
    """`{"type": "text", "text": ...}` (extra keys such as `cache_control`, `citations` kept)."""

    type: Literal["text"]
    text: str


class ToolUseBlock(WireModel):
    """A tool call the model made earlier (assistant turn)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(WireModel):
    """The result of a tool call (user turn); `content` is a string or a list of blocks."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Any] | None = None
    is_error: bool | None = None


class ThinkingBlock(WireModel):
    """Reasoning the model did (assistant turn); the signature is opaque and not checked."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(WireModel):
    """Encrypted reasoning from another server: it holds no text we could render."""

    type: Literal["redacted_thinking"]
    data: str | None = None


class OtherBlock(WireModel):
    """Any other block type (`image`, `document`, `server_tool_use`, ...): refused by the converter."""

    type: str


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_tag(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return t if t in _BLOCK_TYPES else "other"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_tag),
]


class MessageParam(WireModel):
    """One turn: `user` or `assistant` (the newest API also allows `system` turns)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolParam(WireModel):
    """A tool: custom tools have no `type` (or `"custom"`); server tools have a dated type."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoiceParam(WireModel):
    """`auto`, `any`, `tool` (with `name`) or `none`."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(WireModel):
    """`thinking`: `enabled` (with `budget_tokens`), `disabled` or `adaptive`."""

    type: str
    budget_tokens: StrictInt | None = None


class MessagesRequest(WireModel):
    """Body of `POST /v1/messages`."""

    model: str = "default"
    messages: list[MessageParam]
    max_tokens: StrictInt | None = None
    """Required by the spec; optional here so that its absence is a 400 we word ourselves."""
    container: Any = None
    context_management: dict[str, Any] | None = None
    """Server-side edits of the history (clearing old thinking or tool results): recorded, not
    applied: the whole history is rendered, so the recorded prompt is what the policy saw."""
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    """`{"effort": ...}`: handed to the chat template as `reasoning_effort`, and recorded."""
    service_tier: str | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    system: str | list[TextBlock] | None = None
    temperature: StrictFloat | None = None  # in the API reference; dropped from the anthropic 2.x SDK
    thinking: ThinkingConfig | None = None
    tool_choice: ToolChoiceParam | None = None
    tools: list[ToolParam] | None = None
    top_k: StrictInt | None = None  # in the API reference; dropped from the anthropic 2.x SDK
    top_p: StrictFloat | None = None  # in the API reference; dropped from the anthropic 2.x SDK
    chat_template_kwargs: dict[str, Any] | None = None  # extension (as vLLM's Messages route)


__all__ = [
    "ContentBlock",
    "MessageParam",
    "MessagesRequest",
    "OtherBlock",
    "RedactedThinkingBlock",
    "TextBlock",
    "ThinkingBlock",
    "ThinkingConfig",
    "ToolChoiceParam",
    "ToolParam",
    "ToolResultBlock",
    "ToolUseBlock",
]
