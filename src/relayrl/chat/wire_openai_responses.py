"""OpenAI Responses on the wire: request → `CompletionRequest`, `Completion` → JSON, SSE events.

Pure functions and one stream encoder; no FastAPI, no engine. We are stateless per call, so
everything that needs server-side state (`previous_response_id`, `conversation`, `background`)
is a 400 that says so; the client sends the full `input` instead, as it does with `store=false`.
Output is a reasoning item (raw reasoning as `reasoning_text` content), one message item, then
one `function_call` item per call. Item ids derive from the response id and the output index, so
a streamed response and its non-streamed rendering agree item for item.

The tradeoff: Responses logprobs are not offered (they cover only output text on this wire, while
our tokens also hold reasoning and tool calls); `/v1/chat/completions` returns them.

May import: pydantic, `relayrl.chat.completion`, `.conversation`, `.schema`, `.wire_common`,
`relayrl.errors`. Never another `wire_*` module, FastAPI, an engine or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relayrl.chat.completion import (
    Completion,
    CompletionRequest,
    ReplyFinish,
    TokenLogprob,
)
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
from relayrl.chat.responses_tools import (
    ToolKinds,
    call_item,
    custom_call,
    namespaced_call,
    render_tools,
    shell_call,
    streams_as_function,
)
from relayrl.chat.schema.openai_responses import (
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputContentPart,
    LocalShellCallItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    ToolChoiceObject,
)
from relayrl.chat.wire_common import (
    MAX_TOKENS_LIMIT,
    check_extensions,
    check_parallel,
    check_tool_choice,
    invalid,
    join_text,
    openai_error_body,
    parse_model,
    sampling_params,
    sse,
    with_prefix,
)

ID_PREFIX = "resp_"
_TEXT_PARTS = ("input_text", "output_text", "text")

STATUSES: dict[ReplyFinish, str] = {
    "stop": "completed",
    "tool_calls": "completed",
    "length": "incomplete",
    "abort": "incomplete",
}
_INCOMPLETE_REASONS: dict[ReplyFinish, str | None] = {"length": "max_output_tokens", "abort": None}
# Output items of hosted tools: the policy never writes them, so one in `input` was served by
# someone else; it is left out of the prompt (and named in the call's metadata) rather than
# refused, since leaving it out changes no token the policy sampled.
_HOSTED_ITEM_TYPES = frozenset({"web_search_call", "file_search_call", "image_generation_call",
                                "code_interpreter_call", "tool_search_call", "tool_search_output"})
TOOL_KINDS_KEY = "responses_tools"
"""Where a request's metadata keeps its `ToolKinds` (how rendered tools map to wire items)."""


# ---------------------------------------------------------------- request


def parse_body(raw: Any) -> ResponsesRequest:
    """Validate a JSON body as a Responses request (a 400 when it is malformed)."""
    return parse_model(ResponsesRequest, raw)


def to_request(body: ResponsesRequest) -> CompletionRequest:
    """Convert a Responses request into the wire-neutral `CompletionRequest`."""
    _refuse_unhonoured(body)
    check_extensions(body.model_extra or {})
    tools, kinds = render_tools(body.tools)
    tools, choice = _tool_choice(body.tool_choice, tools)
    check_tool_choice(choice, tools)
    check_parallel(body.parallel_tool_calls, tools, choice)
    kwargs = dict(body.chat_template_kwargs or {})
    meta: dict[str, Any] = {"wire": "openai.responses"}
    if not kinds.plain() or kinds.hosted:
        meta[TOOL_KINDS_KEY] = kinds.as_dict()
    if body.reasoning is not None:
        # we cannot change how much the policy reasons; templates that know the effort render it
        meta["reasoning"] = body.reasoning.model_dump(exclude_none=True)
        if body.reasoning.effort is not None:
            kwargs.setdefault("reasoning_effort", body.reasoning.effort)
    if body.metadata:
        meta["metadata"] = body.metadata
    if body.user:
        meta["user"] = body.user
    messages, left_out = _messages(body)
    if left_out:
        meta["left_out_items"] = left_out
    conv = Conversation(messages=messages, tools=tools, tool_choice=choice,
                        template_kwargs=kwargs)
    # No max_output_tokens means no limit on this API: the room the context leaves (the gateway
    # clamps to it), not a default cap that would end the reply `incomplete`.
    max_tokens = MAX_TOKENS_LIMIT if body.max_output_tokens is None else body.max_output_tokens
    params = sampling_params(max_tokens=max_tokens, temperature=body.temperature,
                             top_p=body.top_p, top_k=body.top_k, stop=(), seed=None,
                             top_logprobs=0, names={"max_tokens": "max_output_tokens"})
    return CompletionRequest(conversation=conv, params=params, model=body.model, n=1,
                             stream=bool(body.stream), metadata=meta)


def _refuse_unhonoured(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise invalid("previous_response_id is not supported: this server keeps no responses; "
                      "send the whole conversation in `input`", "previous_response_id")
    if body.conversation is not None:
        raise invalid("conversation is not supported: this server keeps no conversations; "
                      "send the whole conversation in `input`", "conversation")
    if body.background:
        raise invalid("background responses are not supported", "background")
    if body.prompt is not None:
        raise invalid("stored prompts are not supported", "prompt")
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        raise invalid(f"text.format {fmt.type!r} is not supported: we do not constrain "
                      "decoding (only 'text')", "text.format")
    if "message.output_text.logprobs" in (body.include or ()) or body.top_logprobs:
        raise invalid("logprobs are not offered on /v1/responses; use /v1/chat/completions",
                      "top_logprobs" if body.top_logprobs else "include")


def _tool_choice(tc: str | ToolChoiceObject | None,
                 tools: tuple[Tool, ...]) -> tuple[tuple[Tool, ...], ToolChoice]:
    if tc is None or isinstance(tc, str):
        return tools, tc or "auto"
    if tc.type == "function" and tc.name:
        return tools, tc.name
    if tc.type == "allowed_tools" and tc.tools is not None:
        names = {t.get("name") for t in tc.tools}
        unknown = names - {t.name for t in tools}
        if tc.mode not in ("auto", "required") or unknown:
            raise invalid(f"allowed_tools must name listed tools with mode auto|required "
                          f"(unknown: {sorted(map(str, unknown))})", "tool_choice")
        return tuple(t for t in tools if t.name in names), tc.mode
    raise invalid(f"tool_choice type {tc.type!r} is not supported", "tool_choice")


@dataclass
class _AssistantTurn:
    """Items of one assistant turn, gathered until a non-assistant item arrives."""

    reasoning: str | None = None
    content: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)

    def empty(self) -> bool:
        return self.reasoning is None and not self.content and not self.calls

    def message(self) -> Message:
        return Message(role="assistant", content=join_text(self.content),
                       reasoning=self.reasoning, tool_calls=tuple(self.calls))


def _messages(body: ResponsesRequest) -> tuple[tuple[Message, ...], list[str]]:
    out: list[Message] = []
    left_out: list[str] = []
    if body.instructions:
        out.append(Message(role="system", content=body.instructions))
    if isinstance(body.input, str):
        return (*out, Message(role="user", content=body.input)), left_out
    turn = _AssistantTurn()
    names: dict[str, str] = {}  # call_id -> function name, for tool messages

    def flush() -> None:
        nonlocal turn
        if not turn.empty():
            out.append(turn.message())
        turn = _AssistantTurn()

    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if isinstance(item, MessageItem) and item.role == "assistant":
            if turn.content or turn.calls:
                flush()
            turn.content.append(_text(item.content, where))
        elif isinstance(item, MessageItem):
            flush()
            out.append(Message(role="user" if item.role == "user" else "system",
                               content=_text(item.content, where)))
        elif isinstance(item, FunctionCallItem):
            call = (namespaced_call(item.call_id, item.namespace, item.name, item.arguments)
                    if item.namespace else
                    ToolCall(id=item.call_id, name=item.name, arguments=item.arguments))
            turn.calls.append(call)
            names[item.call_id] = call.name
        elif isinstance(item, CustomToolCallItem | LocalShellCallItem):
            call = (custom_call(item.call_id, item.name, item.input)
                    if isinstance(item, CustomToolCallItem) else shell_call(item.call_id,
                                                                            item.action))
            turn.calls.append(call)
            names[item.call_id] = call.name
        elif isinstance(item, FunctionCallOutputItem | CustomToolCallOutputItem):
            flush()
            out.append(Message(role="tool", content=_text(item.output, where),
                               tool_call_id=item.call_id,
                               name=item.name or names.get(item.call_id)))
        elif isinstance(item, ReasoningItem):
            if not turn.empty():
                flush()
            parts = item.content if item.content else item.summary
            turn.reasoning = join_text([p.text for p in parts])
        elif item.type in _HOSTED_ITEM_TYPES:
            left_out.append(item.type)
        else:
            raise invalid(f"input item type {item.type!r} is not supported", where)
    flush()
    if not out:
        raise invalid("input must not be empty", "input")
    return tuple(out), left_out


def _text(content: str | list[InputContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, p in enumerate(content):
        if p.type in _TEXT_PARTS and p.text is not None:
            texts.append(p.text)
        elif p.type == "refusal" and p.refusal is not None:
            texts.append(p.refusal)
        else:
            raise invalid(f"content part type {p.type!r} is not supported (text only)",
                          f"{where}.content[{j}]")
    return join_text(texts)


# ---------------------------------------------------------------- response


def error_body(exc: BaseException) -> dict[str, Any]:
    """OpenAI's error body, which the Responses API shares with Chat Completions."""
    return openai_error_body(exc)


def render_completion(c: Completion, request: CompletionRequest | None = None) -> dict[str, Any]:
    """The `response` JSON object of a finished call (one choice: Responses has no `n`)."""
    if len(c.choices) != 1:
        raise ValueError(f"a Responses reply has exactly one choice, got {len(c.choices)}")
    ch = c.choices[0]
    rid = with_prefix(c.id, ID_PREFIX)
    return response_object(rid, c.model, c.created, finish=ch.finish_reason,
                           output=output_items(rid, ch.reply, ch.finish_reason, _kinds(request)),
                           usage=usage(c.prompt_tokens, c.completion_tokens),
                           request=request, interaction_id=ch.interaction_id)


def _kinds(request: CompletionRequest | None) -> ToolKinds:
    return ToolKinds.from_dict(request.metadata.get(TOOL_KINDS_KEY) if request else None)


def output_items(rid: str, reply: ParsedReply, finish: ReplyFinish,
                 kinds: ToolKinds | None = None) -> list[dict[str, Any]]:
    """Output items of a reply: reasoning, message, then one call item per tool call."""
    kinds = kinds or ToolKinds()
    items: list[dict[str, Any]] = []
    if reply.reasoning:
        items.append(_reasoning_item(item_id("rs", rid, len(items)), reply.reasoning))
    if reply.content:
        items.append(_message_item(item_id("msg", rid, len(items)), reply.content))
    for call in reply.tool_calls:
        items.append(call_item(kinds, item_id("fc", rid, len(items)), call.id, call.name,
                               call.arguments, "completed"))
    if items and STATUSES[finish] != "completed":
        items[-1]["status"] = "incomplete"  # the reply was cut inside its last item
    return items


def item_id(kind: str, rid: str, output_index: int) -> str:
    """Deterministic id of output item `output_index` (`msg_...`, `fc_...`, `rs_...`)."""
    return f"{kind}_{rid.removeprefix(ID_PREFIX)}_{output_index}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The `usage` object (we do not count cached or reasoning tokens apart: 0)."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def response_object(rid: str, model: str, created: int, *, finish: ReplyFinish | None,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None,
                    request: CompletionRequest | None,
                    interaction_id: str | None) -> dict[str, Any]:
    """A `response` object; `finish=None` means still in progress."""
    status = "in_progress" if finish is None else STATUSES[finish]
    p = request.params if request is not None else None
    conv = request.conversation if request is not None else None
    meta = request.metadata.get("metadata") if request is not None else None
    obj: dict[str, Any] = {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "error": None,
        "incomplete_details": ({"reason": _INCOMPLETE_REASONS[finish]}
                               if finish is not None and status == "incomplete" else None),
        "instructions": None,
        "max_output_tokens": p.max_new_tokens if p else None,
        "model": model, "output": output, "parallel_tool_calls": True,
        "previous_response_id": None, "reasoning": None,
        "temperature": p.temperature if p else None,
        "text": {"format": {"type": "text"}},
        "tool_choice": _tool_choice_out(conv.tool_choice) if conv else "auto",
        "tools": [_tool_out(t) for t in conv.tools] if conv else [],
        "top_p": p.top_p if p else None,
        "truncation": "disabled", "usage": usage, "user": None,
        "metadata": {k: str(v) for k, v in (meta or {}).items()},
    }
    if interaction_id is not None:
        obj["interaction_id"] = interaction_id  # extension: what set_reward takes
    return obj


def _tool_choice_out(choice: ToolChoice) -> str | dict[str, str]:
    return choice if choice in ("auto", "none", "required") else {"type": "function",
                                                                  "name": choice}


def _tool_out(t: Tool) -> dict[str, Any]:
    return {"type": "function", "name": t.name, "description": t.description or None,
            "parameters": t.parameters, "strict": None}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(id_: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [_text_part(text)] if status != "in_progress" else []
    return {"id": id_, "type": "message", "role": "assistant", "status": status,
            "content": content}


def _reasoning_item(id_: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": id_, "type": "reasoning", "summary": [], "content": content, "status": status}


# ---------------------------------------------------------------- streaming


@dataclass
class _OpenItem:
    """The output item being streamed: its kind, position, id and text so far."""

    kind: str  # "reasoning" | "message" | "function_call"
    index: int
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    tool_index: int = -1
    whole: bool = False
    """A custom or shell call: sent whole when it ends, not as argument deltas."""


class StreamEncoder:
    """Turns reply deltas into Responses SSE events (`event: response.*`), numbered in sequence.

    Call order: `start`, any number of `delta`, `finish`, then `end` (which sends
    `response.completed`, or `response.incomplete` when the reply was cut). Only choice 0 exists.
    """

    def __init__(self, completion_id: str, model: str, created: int, *, n: int = 1,
                 include_usage: bool = False, logprobs: bool = False,
                 request: CompletionRequest | None = None) -> None:
        if n != 1:
            raise ValueError("a Responses stream has exactly one choice")
        self.id = with_prefix(completion_id, ID_PREFIX)
        self.model, self.created, self.request = model, created, request
        del include_usage, logprobs  # usage is always sent; logprobs are not offered here
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # finished output items, in order
        self._open: _OpenItem | None = None
        self._finish: ReplyFinish | None = None
        self._interaction_id: str | None = None
        self._kinds = _kinds(request)

    @classmethod
    def for_request(cls, req: CompletionRequest, completion_id: str,
                    created: int) -> StreamEncoder:
        """An encoder configured from a parsed request."""
        return cls(completion_id, req.model, created, n=req.n, request=req)

    def start(self, prompt_tokens: int = 0) -> list[str]:
        """`response.created` and `response.in_progress`."""
        r = self._response(None, None)
        return [self._event("response.created", response=r),
                self._event("response.in_progress", response=r)]

    def delta(self, index: int, d: ReplyDelta | None,
              logprobs: Sequence[TokenLogprob] | None = None) -> list[str]:
        """Events for one reply delta (logprobs are ignored on this wire)."""
        if isinstance(d, ReasoningDelta) and d.text:
            return [*self._ensure("reasoning"), self._text_delta(d.text)]
        if isinstance(d, ContentDelta) and d.text:
            return [*self._ensure("message"), self._text_delta(d.text)]
        if isinstance(d, ToolCallDelta):
            return self._tool_delta(d)
        return []

    def finish(self, index: int, finish_reason: ReplyFinish, interaction_id: str,
               stop_sequence: str | None = None) -> list[str]:
        """Close the open item; remember how the reply ended."""
        self._finish, self._interaction_id = finish_reason, interaction_id
        return self._close(last=True)

    def end(self, prompt_tokens: int, completion_tokens: int) -> list[str]:
        """`response.completed` (or `response.incomplete`) with the whole response."""
        self._finish = finish = self._finish or "abort"  # no finish: the reply was cut off
        frames = self._close(last=True)
        r = self._response(finish, usage(prompt_tokens, completion_tokens))
        kind = "response.completed" if STATUSES[finish] == "completed" else "response.incomplete"
        return [*frames, self._event(kind, response=r)]

    def error(self, exc: BaseException) -> list[str]:
        """An `error` event (the openai SDK yields it as `ResponseErrorEvent`)."""
        e = error_body(exc)["error"]
        return [self._event("error", code=e["code"] or e["type"], message=e["message"],
                            param=e["param"])]

    def keepalive(self) -> list[str]:
        """An SSE comment: keeps proxies from closing an idle stream, ignored by clients."""
        return [": keepalive\n\n"]

    def _response(self, finish: ReplyFinish | None,
                  use: dict[str, Any] | None) -> dict[str, Any]:
        return response_object(self.id, self.model, self.created, finish=finish,
                               output=list(self._items), usage=use, request=self.request,
                               interaction_id=self._interaction_id)

    def _event(self, kind: str, **fields: Any) -> str:
        frame = sse({"type": kind, "sequence_number": self._seq, **fields}, event=kind)
        self._seq += 1
        return frame

    def _ensure(self, kind: str) -> list[str]:
        if self._open is not None and self._open.kind == kind:
            return []
        frames = self._close(last=False)
        out_index = len(self._items)
        prefix = "rs" if kind == "reasoning" else "msg"
        item = _OpenItem(kind, out_index, item_id(prefix, self.id, out_index))
        self._open = item
        if kind == "reasoning":
            added, part = _reasoning_item(item.id, "", "in_progress"), {"type": "reasoning_text",
                                                                         "text": ""}
        else:
            added, part = _message_item(item.id, "", "in_progress"), _text_part("")
        return [*frames,
                self._event("response.output_item.added", output_index=out_index, item=added),
                self._event("response.content_part.added", item_id=item.id,
                            output_index=out_index, content_index=0, part=part)]

    def _text_delta(self, text: str) -> str:
        item = self._open
        assert item is not None  # _ensure ran first
        item.text += text
        kind = ("response.reasoning_text.delta" if item.kind == "reasoning"
                else "response.output_text.delta")
        extra: dict[str, Any] = {"logprobs": []} if item.kind == "message" else {}
        return self._event(kind, item_id=item.id, output_index=item.index, content_index=0,
                           delta=text, **extra)

    def _tool_delta(self, d: ToolCallDelta) -> list[str]:
        frames: list[str] = []
        if d.id is not None:
            frames = self._close(last=False)
            out_index = len(self._items)
            name = d.name or ""
            self._open = _OpenItem("function_call", out_index, item_id("fc", self.id, out_index),
                                   call_id=d.id, name=name, tool_index=d.index,
                                   whole=not streams_as_function(self._kinds, name))
            if not self._open.whole:
                added = call_item(self._kinds, self._open.id, d.id, name, "", "in_progress")
                frames.append(self._event("response.output_item.added", output_index=out_index,
                                          item=added))
        item = self._open
        if item is None or item.kind != "function_call" or item.tool_index != d.index:
            raise ValueError(f"arguments for tool call {d.index} arrived after it was closed")
        if d.arguments:
            item.text += d.arguments
        if d.arguments and not item.whole:
            frames.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=item.index, delta=d.arguments))
        return frames

    def _close(self, *, last: bool) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        cut = last and self._finish is not None and STATUSES[self._finish] != "completed"
        status = "incomplete" if cut else "completed"
        at = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call" and item.whole:
            done = call_item(self._kinds, item.id, item.call_id, item.name, item.text, status)
            frames = self._whole_call(item, done)
        elif item.kind == "function_call":
            done = call_item(self._kinds, item.id, item.call_id, item.name, item.text, status)
            frames = [self._event("response.function_call_arguments.done", **at,
                                  arguments=item.text)]
        elif item.kind == "reasoning":
            done = _reasoning_item(item.id, item.text, status)
            frames = [self._event("response.reasoning_text.done", **at, content_index=0,
                                  text=item.text),
                      self._event("response.content_part.done", **at, content_index=0,
                                  part=done["content"][0])]
        else:
            done = _message_item(item.id, item.text, status)
            frames = [self._event("response.output_text.done", **at, content_index=0,
                                  text=item.text, logprobs=[]),
                      self._event("response.content_part.done", **at, content_index=0,
                                  part=done["content"][0])]
        self._items.append(done)
        return [*frames, self._event("response.output_item.done", output_index=item.index,
                                     item=done)]

    def _whole_call(self, item: _OpenItem, done: dict[str, Any]) -> list[str]:
        at = {"item_id": item.id, "output_index": item.index}
        added = {**done, "status": "in_progress"}
        if done["type"] == "custom_tool_call":
            added["input"] = ""
        frames = [self._event("response.output_item.added", output_index=item.index, item=added)]
        if done["type"] == "custom_tool_call":
            frames += [self._event("response.custom_tool_call_input.delta", **at,
                                   delta=done["input"]),
                       self._event("response.custom_tool_call_input.done", **at,
                                   input=done["input"])]
        return frames


__all__ = [
    "ID_PREFIX",
    "STATUSES",
    "StreamEncoder",
    "error_body",
    "item_id",
    "output_items",
    "parse_body",
    "render_completion",
    "response_object",
    "to_request",
]
