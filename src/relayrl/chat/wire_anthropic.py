"""Anthropic Messages on the wire: request → `CompletionRequest`, `Completion` → JSON, SSE events.

Pure functions and one stream encoder; no FastAPI, no engine. A user turn's `tool_result` blocks
become `tool` messages, and its text blocks one user message after them; an assistant turn's
`thinking` blocks become its reasoning. Tool inputs travel as objects on this wire, so a call whose
arguments are not a JSON object cannot be a `tool_use` block: it is shown as a text block instead.

The tradeoff: the stream holds each tool call back until it is complete (it usually arrives in one
delta anyway), because only a complete argument text tells a `tool_use` block from that text
block; streaming it early could leave the client holding a half-parsed input object for a call
that the non-streamed rendering would show as text.

May import: pydantic, `relayrl.chat.completion`, `.conversation`, `.schema`, `.wire_common`,
`relayrl.errors`. Never another `wire_*` module, FastAPI, an engine or torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from relayrl.chat.completion import Completion, CompletionRequest, ReplyFinish, TokenLogprob
from relayrl.chat.conversation import (
    ContentDelta,
    Conversation,
    Message,
    ParsedReply,
    ReasoningDelta,
    ReplyDelta,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
)
from relayrl.chat.schema.anthropic_messages import (
    MessageParam,
    MessagesRequest,
    OtherBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoiceParam,
    ToolParam,
    ToolResultBlock,
    ToolUseBlock,
)
from relayrl.chat.wire_common import (
    check_extensions,
    check_parallel,
    check_tool_choice,
    check_tools,
    invalid,
    join_text,
    parse_model,
    sampling_params,
    sse,
    with_prefix,
)
from relayrl.errors import RelayError

ID_PREFIX = "msg_"

_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def stop_reason(finish: ReplyFinish, stop_sequence: str | None, has_tool_use: bool) -> str:
    """Our finish reason in Anthropic's terms."""
    if finish == "stop":
        return "stop_sequence" if stop_sequence else "end_turn"
    if finish == "tool_calls":
        return "tool_use" if has_tool_use else "end_turn"
    return "max_tokens"  # length, or abort: the reply was cut short


# ---------------------------------------------------------------- request


def parse_body(raw: Any) -> MessagesRequest:
    """Validate a JSON body as a Messages request (a 400 when it is malformed)."""
    return parse_model(MessagesRequest, raw)


def to_request(body: MessagesRequest) -> CompletionRequest:
    """Convert a Messages request into the wire-neutral `CompletionRequest`."""
    if body.max_tokens is None:
        raise invalid("max_tokens is required", "max_tokens")
    check_extensions(body.model_extra or {})
    tools, server_tools = _tools(body.tools)
    choice = _tool_choice(body.tool_choice)
    check_tool_choice(choice, tools)
    parallel = None if body.tool_choice is None else body.tool_choice.disable_parallel_tool_use
    check_parallel(None if parallel is None else not parallel, tools, choice,
                   "tool_choice.disable_parallel_tool_use")
    kwargs = dict(body.chat_template_kwargs or {})
    meta: dict[str, Any] = {"wire": "anthropic.messages"}
    if body.thinking is not None:
        # the budget cannot be enforced (we do not count thinking tokens apart): recorded only
        meta["thinking"] = body.thinking.model_dump(exclude_none=True)
        if body.thinking.type in ("enabled", "disabled"):
            kwargs.setdefault("enable_thinking", body.thinking.type == "enabled")
    if body.metadata:
        meta["metadata"] = body.metadata
    if server_tools:
        meta["server_tools"] = server_tools  # the policy cannot run them: left out of the prompt
    if body.context_management:
        meta["context_management"] = body.context_management
    if body.output_config:
        meta["output_config"] = body.output_config
        if body.output_config.get("effort") is not None:
            kwargs.setdefault("reasoning_effort", body.output_config["effort"])
    conv = Conversation(messages=_messages(body), tools=tools, tool_choice=choice,
                        template_kwargs=kwargs)
    params = sampling_params(max_tokens=body.max_tokens, temperature=body.temperature,
                             top_p=body.top_p, top_k=body.top_k,
                             stop=tuple(body.stop_sequences or ()), seed=None, top_logprobs=0,
                             max_temperature=1.0)
    return CompletionRequest(conversation=conv, params=params, model=body.model, n=1,
                             stream=bool(body.stream), metadata=meta)


# Tools Anthropic's servers run (search, fetch, code execution): the policy cannot, so they are
# left out of the prompt and named in the call's metadata. Anthropic-defined client tools
# (`bash_*`, `text_editor_*`, `computer_*`) carry no schema we could render: still refused.
_SERVER_TOOL_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")


def _tools(specs: list[ToolParam] | None) -> tuple[tuple[Tool, ...], list[str]]:
    tools = []
    server: list[str] = []
    for i, s in enumerate(specs or ()):
        if s.type is not None and s.type.startswith(_SERVER_TOOL_PREFIXES):
            server.append(s.type)
            continue
        if s.type not in (None, "custom"):
            raise invalid(f"tool type {s.type!r} is not supported (custom tools, or server "
                          "tools, which are left out)", f"tools.{i}")
        tools.append(Tool(name=s.name, description=s.description or "",
                          parameters=s.input_schema or {}))
    check_tools(tools, "tools")
    return tuple(tools), server


def _tool_choice(tc: ToolChoiceParam | None) -> ToolChoice:
    if tc is None or tc.type == "auto":
        return "auto"
    if tc.type == "any":
        return "required"
    if tc.type == "none":
        return "none"
    if not tc.name:
        raise invalid("tool_choice of type 'tool' needs a name", "tool_choice.name")
    return tc.name


def _messages(body: MessagesRequest) -> tuple[Message, ...]:
    out: list[Message] = []
    if body.system:
        out.append(Message(role="system", content=_system_text(body.system)))
    names: dict[str, str] = {}  # tool_use id -> tool name, for tool messages
    for i, turn in enumerate(body.messages):
        where = f"messages.{i}"
        if turn.role == "system":
            # Anthropic documents only user and assistant turns, but the Claude Code CLI (and so
            # the Claude Agent SDK) sends system turns inside `messages`: refusing them would
            # break a real client, so they become system messages in place.
            out.append(Message(role="system", content=_system_text(turn.content, where)))
            continue
        if turn.role == "user":
            out.extend(_user_turn(turn, where, names))
        else:
            out.append(_assistant_turn(turn, where, names))
    if not body.messages:
        raise invalid("messages must not be empty", "messages")
    if body.messages[-1].role == "assistant":
        raise invalid("a final assistant message (prefill) is not supported", "messages")
    return tuple(out)


def _system_text(content: str | Sequence[Any], where: str = "system") -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, b in enumerate(content):
        if not isinstance(b, TextBlock):
            raise invalid(f"block type {b.type!r} is not allowed here (text only)", f"{where}.{j}")
        texts.append(b.text)
    return join_text(texts)


def _user_turn(turn: MessageParam, where: str, names: dict[str, str]) -> list[Message]:
    if isinstance(turn.content, str):
        return [Message(role="user", content=turn.content)]
    tools: list[Message] = []
    texts: list[str] = []
    for j, b in enumerate(turn.content):
        at = f"{where}.content.{j}"
        if isinstance(b, ToolResultBlock):
            tools.append(Message(role="tool", content=_result_text(b.content, at),
                                 tool_call_id=b.tool_use_id, name=names.get(b.tool_use_id)))
        elif isinstance(b, TextBlock):
            texts.append(b.text)
        else:
            raise invalid(f"block type {b.type!r} is not supported in a user turn", at)
    user = [Message(role="user", content=join_text(texts))] if texts else []
    return [*tools, *user]


def _result_text(content: str | list[Any] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text" or not isinstance(b.get("text"), str):
            raise invalid(f"tool_result content block {kind!r} is not supported (text only)",
                          f"{where}.content.{k}")
        texts.append(b["text"])
    return join_text(texts)


def _assistant_turn(turn: MessageParam, where: str, names: dict[str, str]) -> Message:
    if isinstance(turn.content, str):
        return Message(role="assistant", content=turn.content)
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, b in enumerate(turn.content):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ThinkingBlock):
            thoughts.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append(ToolCall(id=b.id, name=b.name,
                                  arguments=json.dumps(b.input, ensure_ascii=False)))
            names[b.id] = b.name
        elif isinstance(b, RedactedThinkingBlock):
            continue  # encrypted by another server: no text to render, and we never emit them
        else:
            kind = b.type if isinstance(b, OtherBlock) else type(b).__name__
            raise invalid(f"block type {kind!r} is not supported in an assistant turn",
                          f"{where}.content.{j}")
    return Message(role="assistant", content=join_text(texts),
                   reasoning=join_text(thoughts) if thoughts else None, tool_calls=tuple(calls))


# ---------------------------------------------------------------- response


def tool_input(call: ToolCall) -> dict[str, Any] | None:
    """The call's input object, or None when its arguments are not a JSON object."""
    try:
        obj = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def broken_call_text(call: ToolCall) -> str:
    """How a call with non-object arguments is shown: as the text the model meant as a call."""
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)


def content_blocks(reply: ParsedReply) -> list[dict[str, Any]]:
    """Content blocks of a reply: thinking, text, then one block per tool call."""
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        inp = tool_input(call)
        if inp is None:
            blocks.append({"type": "text", "text": broken_call_text(call)})
        else:
            blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": inp})
    return blocks


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The `usage` object (no prompt cache: its counters are 0)."""
    return {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def render_completion(c: Completion, request: CompletionRequest | None = None) -> dict[str, Any]:
    """The `message` JSON object of a finished call (one choice: Messages has no `n`)."""
    if len(c.choices) != 1:
        raise ValueError(f"a Messages reply has exactly one choice, got {len(c.choices)}")
    ch = c.choices[0]
    blocks = content_blocks(ch.reply)
    has_tool_use = any(b["type"] == "tool_use" for b in blocks)
    reason = stop_reason(ch.finish_reason, ch.stop_sequence, has_tool_use)
    return {
        "id": with_prefix(c.id, ID_PREFIX), "type": "message", "role": "assistant",
        "model": c.model, "content": blocks, "stop_reason": reason,
        "stop_sequence": ch.stop_sequence if reason == "stop_sequence" else None,
        "usage": usage(c.prompt_tokens, c.completion_tokens),
        "interaction_id": ch.interaction_id,  # extension: what set_reward takes
    }


def error_body(exc: BaseException) -> dict[str, Any]:
    """Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`."""
    status = exc.status_code if isinstance(exc, RelayError) else 500
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                       "message": str(exc) or type(exc).__name__}}


# ---------------------------------------------------------------- streaming


class StreamEncoder:
    """Turns reply deltas into Messages SSE events (`message_start` ... `message_stop`).

    Call order: `start`, any number of `delta`, `finish`, then `end`. Only choice 0 exists.
    Text and thinking stream as they come; a tool call is held until it is complete.
    """

    def __init__(self, completion_id: str, model: str, created: int, *, n: int = 1,
                 include_usage: bool = False, logprobs: bool = False,
                 request: CompletionRequest | None = None) -> None:
        if n != 1:
            raise ValueError("a Messages stream has exactly one choice")
        self.id = with_prefix(completion_id, ID_PREFIX)
        self.model = model
        del created, include_usage, logprobs, request  # not on this wire
        self._blocks = 0  # blocks started so far
        self._open: str | None = None  # type of the open text/thinking block
        self._call: list[str] | None = None  # [id, name, arguments] of the held tool call
        self._tool_use = False
        self._reason: str | None = None  # set by `finish`
        self._stop_sequence: str | None = None
        self._interaction_id: str | None = None

    @classmethod
    def for_request(cls, req: CompletionRequest, completion_id: str,
                    created: int) -> StreamEncoder:
        """An encoder configured from a parsed request."""
        return cls(completion_id, req.model, created, n=req.n, request=req)

    def start(self, prompt_tokens: int = 0) -> list[str]:
        """`message_start` (with the prompt's token count) and a `ping`."""
        message: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(prompt_tokens, 0)}
        return [self._event("message_start", message=message), *self.keepalive()]

    def delta(self, index: int, d: ReplyDelta | None,
              logprobs: Sequence[TokenLogprob] | None = None) -> list[str]:
        """Events for one reply delta (logprobs are not on this wire)."""
        if isinstance(d, ReasoningDelta) and d.text:
            return [*self._ensure("thinking"),
                    self._block_delta({"type": "thinking_delta", "thinking": d.text})]
        if isinstance(d, ContentDelta) and d.text:
            return [*self._ensure("text"),
                    self._block_delta({"type": "text_delta", "text": d.text})]
        if isinstance(d, ToolCallDelta):
            if d.id is not None:
                frames = self._close()
                self._call = [d.id, d.name or "", d.arguments]
                return frames
            if self._call is None:
                raise ValueError(f"arguments for tool call {d.index} arrived after it was closed")
            self._call[2] += d.arguments
        return []

    def finish(self, index: int, finish_reason: ReplyFinish, interaction_id: str,
               stop_sequence: str | None = None) -> list[str]:
        """Close the last block; remember how the reply ended."""
        frames = self._close()
        self._reason = stop_reason(finish_reason, stop_sequence, self._tool_use)
        self._stop_sequence = stop_sequence if self._reason == "stop_sequence" else None
        self._interaction_id = interaction_id
        return frames

    def end(self, prompt_tokens: int, completion_tokens: int) -> list[str]:
        """`message_delta` (stop reason, final usage) and `message_stop`."""
        frames: list[str] = []
        if self._reason is None:  # `finish` was skipped: the reply was cut off
            frames, self._reason = self._close(), "max_tokens"
        delta = {"stop_reason": self._reason, "stop_sequence": self._stop_sequence}
        u = {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}
        extra = {} if self._interaction_id is None else {"interaction_id": self._interaction_id}
        return [*frames, self._event("message_delta", delta=delta, usage=u, **extra),
                self._event("message_stop")]

    def error(self, exc: BaseException) -> list[str]:
        """An `error` event (the anthropic SDK raises on it)."""
        return [sse(error_body(exc), event="error")]

    def keepalive(self) -> list[str]:
        """A `ping` event (the anthropic SDK skips it)."""
        return [self._event("ping")]

    def _event(self, kind: str, **fields: Any) -> str:
        return sse({"type": kind, **fields}, event=kind)

    def _ensure(self, kind: str) -> list[str]:
        if self._open == kind:
            return []
        frames = self._close()
        block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                 else {"type": "text", "text": ""})
        self._open = kind
        return [*frames, self._event("content_block_start", index=self._blocks,
                                     content_block=block)]

    def _block_delta(self, delta: dict[str, Any]) -> str:
        return self._event("content_block_delta", index=self._blocks, delta=delta)

    def _stop_block(self) -> str:
        frame = self._event("content_block_stop", index=self._blocks)
        self._blocks += 1
        return frame

    def _close(self) -> list[str]:
        """Stop the open text/thinking block, or emit the held tool call as a whole block."""
        if self._open is not None:
            self._open = None
            return [self._stop_block()]
        if self._call is None:
            return []
        call, self._call = ToolCall(*self._call), None
        inp = tool_input(call)
        start: dict[str, Any]
        if inp is None:
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": broken_call_text(call)}
        else:
            self._tool_use = True
            start = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(inp, ensure_ascii=False)}
        return [self._event("content_block_start", index=self._blocks, content_block=start),
                self._block_delta(delta), self._stop_block()]


__all__ = [
    "ID_PREFIX",
    "StreamEncoder",
    "broken_call_text",
    "content_blocks",
    "error_body",
    "parse_body",
    "render_completion",
    "stop_reason",
    "to_request",
    "tool_input",
]
