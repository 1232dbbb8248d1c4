"""relayrl.chat: conversations, the chat-template renderer, reply parsers, and the wire formats
(OpenAI Chat Completions, OpenAI Responses, Anthropic Messages) as pure converters.

The pure records are imported here; `Renderer` (jinja2 and tokenizers) and the wire modules load
on first use of their names, so `relayrl.trajectory`, which needs only the records, stays light.

May import: `relayrl.types`, `relayrl.errors`, pydantic, jinja2, tokenizers. Never trajectory,
engine, gateway or anything above, nor torch or FastAPI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from relayrl.chat.completion import Choice, Completion, CompletionRequest, TokenLogprob
from relayrl.chat.conversation import (
    ContentDelta,
    Conversation,
    Message,
    ParsedReply,
    ReasoningDelta,
    Tool,
    ToolCall,
    ToolCallDelta,
    canonical_message,
)

if TYPE_CHECKING:
    from relayrl.chat import wire_anthropic, wire_openai_chat, wire_openai_responses
    from relayrl.chat.parsers import StreamingReplyParser, parse_reply
    from relayrl.chat.renderer import Renderer
    from relayrl.chat.wire_common import WireFormat

_LAZY = {
    "Renderer": ("relayrl.chat.renderer", "Renderer"),
    "StreamingReplyParser": ("relayrl.chat.parsers", "StreamingReplyParser"),
    "WireFormat": ("relayrl.chat.wire_common", "WireFormat"),
    "parse_reply": ("relayrl.chat.parsers", "parse_reply"),
    "wire_anthropic": ("relayrl.chat.wire_anthropic", None),
    "wire_openai_chat": ("relayrl.chat.wire_openai_chat", None),
    "wire_openai_responses": ("relayrl.chat.wire_openai_responses", None),
}

__all__ = [
    "Choice",
    "Completion",
    "CompletionRequest",
    "ContentDelta",
    "Conversation",
    "Message",
    "ParsedReply",
    "ReasoningDelta",
    "Renderer",
    "StreamingReplyParser",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "WireFormat",
    "canonical_message",
    "parse_reply",
    "wire_anthropic",
    "wire_openai_chat",
    "wire_openai_responses",
]


def __getattr__(name: str) -> Any:
    # PEP 562: the heavier parts load when first named
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)
