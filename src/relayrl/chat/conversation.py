"""The internal conversation model that all three wire formats parse into.

OpenAI Chat Completions, OpenAI Responses and Anthropic Messages each convert to and from these
records; nothing wire-specific passes that step. Records are frozen so they can be hashed and
shared between the renderer, the session tree and the durable log.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    """One function call written by the model."""

    id: str
    name: str
    arguments: str
    """The arguments as a JSON text (as OpenAI sends them); may be invalid JSON if the model erred."""

    def arguments_obj(self) -> Any:
        """The arguments parsed from JSON, or the raw text when they are not valid JSON."""
        try:
            return json.loads(self.arguments)
        except (json.JSONDecodeError, TypeError):
            return self.arguments


@dataclass(frozen=True)
class Message:
    """One turn of a conversation."""

    role: Role
    content: str = ""
    reasoning: str | None = None
    """Reasoning text (`<think>` block, `reasoning_content`, thinking blocks), kept apart from content."""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    """For `role == "tool"`: the id of the call this message answers."""
    name: str | None = None
    """For `role == "tool"`: the tool's name, when the wire format gives it."""

    @functools.cached_property
    def canonical_bytes(self) -> bytes:
        """`canonical_message(self)` in UTF-8 (a lone surrogate kept), computed once per turn."""
        # Plain turns are interned across requests (the wire converters), and a session's parent
        # lookup hashes every turn of every call: the cache makes a re-sent turn nearly free.
        return canonical_message(self).encode("utf-8", "surrogatepass")

    @functools.cached_property
    def verbatim_key(self) -> tuple[Any, ...]:
        """Every field a chat template reads, as a hashable tuple, computed once per turn."""
        # the gateway's render cache keys conversations by these; re-sent turns are interned
        calls = tuple([(c.id, c.name, c.arguments) for c in self.tool_calls])
        return (self.role, self.content, self.reasoning, self.tool_call_id, self.name, calls)


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    """JSON schema of the arguments."""

    def __hash__(self) -> int:
        return hash((self.name, self.description, json.dumps(self.parameters, sort_keys=True)))


ToolChoice = Literal["auto", "none", "required"] | str
"""`auto`, `none`, `required`, or the name of one function the model must call."""


@dataclass(frozen=True)
class Conversation:
    """Messages plus everything that changes how they are rendered into a prompt."""

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template (`chat_template_kwargs`), e.g. `enable_thinking`."""

    def __hash__(self) -> int:
        return hash((self.messages, self.tools, self.tool_choice,
                     json.dumps(self.template_kwargs, sort_keys=True, default=str)))

    def rendered_tools(self) -> tuple[Tool, ...]:
        """Tools the template should show: none when `tool_choice == "none"`."""
        return () if self.tool_choice == "none" else self.tools


def canonical_message(m: Message) -> str:
    """A canonical text of a message: equal for messages a client may legitimately re-send.

    Forgiven: key order and spacing in tool-call arguments (compared as parsed JSON; "" and "{}"
    are the same), whitespace around content, None vs empty fields, and reasoning (most clients do
    not send it back; the stored tokens keep it anyway). Used by the session's parent lookup and
    by `Renderer.extend`, so a parent the session finds is one `extend` accepts.
    """
    # Length-prefixed fields (`len:value`, optional ones tagged): unambiguous, and far cheaper
    # than JSON; every call hashes every message of its history.
    role, content = m.role, (m.content or "").strip()
    text = f"{len(role)}:{role}{len(content)}:{content}"
    if m.tool_call_id:
        text += f"i{len(m.tool_call_id)}:{m.tool_call_id}"
    if m.name:
        text += f"n{len(m.name)}:{m.name}"
    for c in m.tool_calls:
        args = canonical_arguments(c.arguments)
        text += f"t{len(c.id)}:{c.id}{len(c.name)}:{c.name}{len(args)}:{args}"
    return text


def canonical_arguments(arguments: str | None) -> str:
    """Tool-call arguments with key order and spacing normalized (raw text if not JSON)."""
    text = (arguments or "").strip()
    if not text:
        return "{}"  # clients send "" and "{}" alike for a call without arguments
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False)
    except json.JSONDecodeError:
        return text


@dataclass(frozen=True)
class ParsedReply:
    """What the parsers make of a model's output text."""

    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    def to_message(self) -> Message:
        """The reply as an assistant message, to append to the conversation."""
        return Message(role="assistant", content=self.content, reasoning=self.reasoning,
                       tool_calls=self.tool_calls)


@dataclass(frozen=True)
class ContentDelta:
    """Streamed visible text."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Streamed reasoning text (inside `<think>`)."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """Streamed part of a tool call.

    The first delta of a call carries `id` and `name` (and usually all of `arguments`, since a call
    is emitted once the parser recognizes it); later deltas of the same `index` carry only
    `arguments` text to append.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


ReplyDelta = ContentDelta | ReasoningDelta | ToolCallDelta
"""One streamed piece of an assistant reply, in the order the model wrote it."""
