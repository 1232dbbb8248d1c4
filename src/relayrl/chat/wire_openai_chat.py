"""OpenAI Chat Completions on the wire: request → `CompletionRequest`, `Completion` → JSON, SSE.

Pure functions and one stream encoder; no FastAPI, no engine. A field that would change sampling
and that we cannot honour (penalties, logit bias, JSON mode, audio, ...) is a 400 naming the
field, never a silent drop; harmless unknown fields are accepted (the gateway logs them once).
Reasoning goes out as `reasoning_content` (the name DeepSeek, SGLang and the openai-agents SDK
read) and comes back in as either `reasoning_content` or `reasoning`.

The helpers all three wire formats share (validation, sampling checks, SSE framing, OpenAI's error
body) live in `wire_common`.

May import: pydantic, `relayrl.chat.completion`, `.conversation`, `.schema`, `.wire_common`,
`relayrl.errors`, `relayrl.types`. Never another `wire_*` module, FastAPI, an engine or torch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from pydantic import PrivateAttr, ValidationError

from relayrl.chat.completion import (
    Choice,
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
    Role,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
)
from relayrl.chat.schema.openai_chat import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    NamedToolChoice,
    ToolCallSpec,
    ToolSpec,
)
from relayrl.chat.wire_common import (
    DEFAULT_MAX_TOKENS,
    JSON_ENCODER,
    check_extensions,
    check_parallel,
    check_tool_choice,
    check_tools,
    invalid,
    join_text,
    openai_error_body,
    parse_model,
    sampling_params,
    sse,
    with_prefix,
)

MAX_N = 16
"""Most choices one request may ask for."""
MAX_STOP = 4
"""Most stop strings, as OpenAI allows."""
MAX_TOP_LOGPROBS = 20
REASONING_FIELD = "reasoning_content"
"""Name of the reasoning field we emit on assistant messages and deltas."""
ID_PREFIX = "chatcmpl-"

FINISH_REASONS: dict[ReplyFinish, str] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "abort": "length",  # no "aborted" on this wire: the reply was cut short, as with length
}

def error_body(exc: BaseException) -> dict[str, Any]:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    return openai_error_body(exc)


def token_bytes(token: str) -> list[int]:
    """UTF-8 bytes of a token string, as OpenAI's logprobs show them."""
    return list(token.encode("utf-8"))


def logprob_entries(lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """`logprobs.content` entries: token, logprob, bytes and the top alternatives."""
    return [{
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": token_bytes(lp.token),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": token_bytes(t)} for t, v in lp.top],
    } for lp in lps]



# ---------------------------------------------------------------- request


class ChatBody(ChatCompletionRequest):
    """A validated request whose plain turns skipped pydantic (`parse_body`).

    `messages` holds only the messages that needed validating; `plain_turns` has one entry per
    message of the request, the ready turn or None where the next of `messages` goes.
    """

    _plain_turns: list[Message | None] | None = PrivateAttr(default=None)


def parse_body(raw: Any) -> ChatCompletionRequest:
    """Validate a JSON body as a Chat Completions request (a 400 when it is malformed)."""
    turns = _plain_turns(raw)
    if turns is None:
        return parse_model(ChatCompletionRequest, raw)
    # A plain `{"role", "content"}` turn is most of a long history and costs pydantic about
    # 1 µs to validate as the 12-field ChatMessage; it is checked and converted here instead.
    rest = [m for m, t in zip(raw["messages"], turns, strict=True) if t is None]
    try:
        body = ChatBody.model_validate({**raw, "messages": rest})
    except ValidationError:
        return parse_model(ChatCompletionRequest, raw)  # the error, with the request's indices
    body._plain_turns = turns
    return body


_PLAIN_ROLES: dict[str, Role] = {"user": "user", "system": "system", "developer": "system",
                                 "assistant": "assistant"}


def _plain_turns(raw: Any) -> list[Message | None] | None:
    """Each message of `raw` as a ready turn when it is exactly `{"role", "content": str}`
    (what `_plain` would make of it), else None; None for all when none is plain."""
    msgs = raw.get("messages") if type(raw) is dict else None
    if type(msgs) is not list:
        return None
    turns: list[Message | None] = []
    found = False
    for m in msgs:
        turn = None
        if type(m) is dict and len(m) == 2:
            raw_role, content = m.get("role"), m.get("content")
            # any JSON value: a list or object role is no key (pydantic names the error)
            role = _PLAIN_ROLES.get(raw_role) if type(raw_role) is str else None
            if role is not None and type(content) is str and len(content) <= INTERN_CHARS:
                turn = _plain_message(role, content)
                found = True
        turns.append(turn)
    return turns if found else None


def to_request(body: ChatCompletionRequest) -> CompletionRequest:
    """Convert a Chat Completions request into the wire-neutral `CompletionRequest`."""
    _refuse_unhonoured(body)
    check_extensions(body.model_extra or {})
    tools = _tools(body.tools)
    tools, choice = _tool_choice(body.tool_choice, tools)
    check_tool_choice(choice, tools)
    check_parallel(body.parallel_tool_calls, tools, choice)
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        # templates that know it (gpt-oss) render it; the others ignore it, as in vLLM
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    turns = body._plain_turns if isinstance(body, ChatBody) else None
    conv = Conversation(messages=_messages(body.messages, turns), tools=tools, tool_choice=choice,
                        template_kwargs=kwargs)
    logprobs, top = _logprobs(body)
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be in [1, {MAX_N}], got {n}", "n")
    meta: dict[str, Any] = {"wire": "openai.chat"}
    if body.metadata:
        meta["metadata"] = body.metadata
    if body.user:
        meta["user"] = body.user
    return CompletionRequest(
        conversation=conv,
        params=sampling_params(max_tokens=_max_tokens(body), temperature=body.temperature,
                               top_p=body.top_p, top_k=body.top_k, stop=_stop(body.stop),
                               seed=body.seed, top_logprobs=top),
        model=body.model,
        n=n,
        stream=bool(body.stream),
        logprobs=logprobs,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        metadata=meta,
    )


def _refuse_unhonoured(body: ChatCompletionRequest) -> None:
    if body.frequency_penalty:
        raise invalid("frequency_penalty is not supported (only 0)", "frequency_penalty")
    if body.presence_penalty:
        raise invalid("presence_penalty is not supported (only 0)", "presence_penalty")
    if body.logit_bias:
        raise invalid("logit_bias is not supported", "logit_bias")
    if body.response_format is not None and body.response_format.type != "text":
        raise invalid(f"response_format {body.response_format.type!r} is not supported: we do "
                      "not constrain decoding (only 'text')", "response_format")
    if body.audio is not None or any(m != "text" for m in body.modalities or ()):
        raise invalid("audio output is not supported (modalities: text only)", "modalities")
    if body.functions or body.function_call is not None:
        raise invalid("functions/function_call are deprecated and not supported: use tools",
                      "functions" if body.functions else "function_call")
    if body.web_search_options is not None:
        raise invalid("web_search_options is not supported", "web_search_options")


def _max_tokens(body: ChatCompletionRequest) -> int | None:
    a, b = body.max_completion_tokens, body.max_tokens
    if a is not None and b is not None and a != b:
        raise invalid(f"max_completion_tokens ({a}) and max_tokens ({b}) disagree; send one",
                      "max_tokens")
    return a if a is not None else b


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP:
        raise invalid(f"at most {MAX_STOP} stop sequences, got {len(stops)}", "stop")
    return stops


def _logprobs(body: ChatCompletionRequest) -> tuple[bool, int]:
    on = bool(body.logprobs)
    top = body.top_logprobs or 0
    if top and not on:
        raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}",
                      "top_logprobs")
    return on, top


def _tools(specs: list[ToolSpec] | None) -> tuple[Tool, ...]:
    tools = []
    for i, s in enumerate(specs or ()):
        if s.type != "function" or s.function is None:
            raise invalid(f"tool type {s.type!r} is not supported (function tools only)",
                          f"tools[{i}]")
        f = s.function
        tools.append(Tool(name=f.name, description=f.description or "",
                          parameters=f.parameters or {}))
    check_tools(tools)
    return tuple(tools)


def _tool_choice(tc: str | NamedToolChoice | None,
                 tools: tuple[Tool, ...]) -> tuple[tuple[Tool, ...], ToolChoice]:
    """The tools to render and the choice; `allowed_tools` narrows the rendered tools."""
    if tc is None or isinstance(tc, str):
        return tools, tc or "auto"
    if tc.type == "function" and tc.function is not None:
        return tools, tc.function.name
    if tc.type == "allowed_tools" and tc.allowed_tools is not None:
        mode = tc.allowed_tools.get("mode", "auto")
        names = {(t.get("function") or {}).get("name") for t in tc.allowed_tools.get("tools", ())}
        unknown = names - {t.name for t in tools}
        if mode not in ("auto", "required") or unknown:
            raise invalid(f"allowed_tools must name listed tools with mode auto|required "
                          f"(unknown: {sorted(map(str, unknown))})", "tool_choice")
        return tuple(t for t in tools if t.name in names), mode
    raise invalid(f"tool_choice type {tc.type!r} is not supported", "tool_choice")


INTERN_CHARS = 4096
"""Plain text turns up to this long are shared between requests (`_plain_message`)."""


@functools.lru_cache(maxsize=4096)
def _plain_message(role: Role, content: str) -> Message:
    # Agents and GRPO groups re-send the same turns call after call; the frozen record costs more
    # to build than to look up, and being immutable it is safe to share.
    return Message(role=role, content=content)


@functools.lru_cache(maxsize=4096)
def _shared_message(m: Message) -> Message:
    # Tool calls and results, by value: an agent re-sends every earlier one on each call, and a
    # shared turn keeps its canonical bytes and render key (the session hashes only new turns).
    return m


def _intern(m: Message) -> Message:
    """`m`, or an equal turn seen before (small turns only: a huge tool result is not kept)."""
    size = len(m.content) + sum(len(c.arguments) for c in m.tool_calls)
    return _shared_message(m) if size <= INTERN_CHARS else m


def forget_interned() -> None:
    """Drop the shared turns (`_plain_message`, `_shared_message`); they refill as requests come."""
    _plain_message.cache_clear()
    _shared_message.cache_clear()


def _messages(msgs: list[ChatMessage],
              turns: list[Message | None] | None = None) -> tuple[Message, ...]:
    if turns is None:
        turns = [None] * len(msgs)
    if not turns:
        raise invalid("messages must not be empty", "messages")
    names: dict[str, str] = {}  # tool_call_id -> function name, for tool messages
    validated = iter(msgs)
    out = []
    for i, turn in enumerate(turns):
        if turn is None:
            m = next(validated)
            turn = _plain(m) or _intern(_message(m, f"messages[{i}]", names))
        out.append(turn)
    return tuple(out)


def _plain(m: ChatMessage) -> Message | None:
    """A text-only system, user or assistant turn (the common case), or None for the rest."""
    content = m.content
    if content is None:
        content = ""
    elif type(content) is not str or len(content) > INTERN_CHARS:
        return None
    if m.role == "user":
        return _plain_message("user", content)
    if m.role in ("system", "developer"):
        return _plain_message("system", content)
    if (m.role != "assistant" or m.tool_calls or m.function_call is not None
            or m.audio is not None or m.reasoning_content is not None or m.reasoning is not None):
        return None
    content = content or m.refusal or ""
    return _plain_message("assistant", content) if len(content) <= INTERN_CHARS else None


def _message(m: ChatMessage, where: str, names: dict[str, str]) -> Message:
    if m.role in ("system", "developer"):
        return Message(role="system", content=_text(m.content, where))
    if m.role == "user":
        return Message(role="user", content=_text(m.content, where))
    if m.role == "tool":
        if not m.tool_call_id:
            raise invalid("a tool message needs tool_call_id", f"{where}.tool_call_id")
        return Message(role="tool", content=_text(m.content, where), tool_call_id=m.tool_call_id,
                       name=m.name or names.get(m.tool_call_id))
    if m.role == "function":
        raise invalid("role 'function' is deprecated and not supported: use role 'tool'",
                      f"{where}.role")
    if m.function_call is not None:
        raise invalid("function_call is deprecated and not supported: use tool_calls",
                      f"{where}.function_call")
    if m.audio is not None:
        raise invalid("assistant audio is not supported", f"{where}.audio")
    calls = tuple(_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m.tool_calls or ()))
    names.update((c.id, c.name) for c in calls)
    content = _text(m.content, where) or (m.refusal or "")
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    return Message(role="assistant", content=content, reasoning=reasoning, tool_calls=calls)


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, p in enumerate(content):
        if p.type == "text" and p.text is not None:
            texts.append(p.text)
        elif p.type == "refusal" and p.refusal is not None:
            texts.append(p.refusal)
        else:
            raise invalid(f"content part type {p.type!r} is not supported (text only)",
                          f"{where}.content[{j}]")
    return join_text(texts)


def _tool_call(c: ToolCallSpec, where: str) -> ToolCall:
    if c.type not in (None, "function") or c.function is None:
        raise invalid(f"tool call type {c.type!r} is not supported (function only)", where)
    args = c.function.arguments
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return ToolCall(id=c.id, name=c.function.name, arguments=args)


# ---------------------------------------------------------------- response


def render_completion(c: Completion, request: CompletionRequest | None = None) -> dict[str, Any]:
    """The `chat.completion` JSON object of a finished call (`request` is unused here)."""
    return {
        "id": with_prefix(c.id, ID_PREFIX),
        "object": "chat.completion",
        "created": c.created,
        "model": c.model,
        "choices": [_choice(ch) for ch in c.choices],
        "usage": usage(c.prompt_tokens, c.completion_tokens),
        "system_fingerprint": None,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The `usage` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice(ch: Choice) -> dict[str, Any]:
    lps = None if ch.logprobs is None else {"content": logprob_entries(ch.logprobs),
                                            "refusal": None}
    return {"index": ch.index, "message": assistant_message(ch.reply), "logprobs": lps,
            "finish_reason": FINISH_REASONS[ch.finish_reason],
            "interaction_id": ch.interaction_id}  # extension: what set_reward takes


def assistant_message(r: ParsedReply) -> dict[str, Any]:
    """The assistant `message` of a choice (content is null when the reply is only tool calls)."""
    msg: dict[str, Any] = {"role": "assistant",
                           "content": r.content if r.content or not r.tool_calls else None,
                           "refusal": None}
    if r.reasoning:
        msg[REASONING_FIELD] = r.reasoning
    if r.tool_calls:
        msg["tool_calls"] = [{"id": t.id, "type": "function",
                              "function": {"name": t.name, "arguments": t.arguments}}
                             for t in r.tool_calls]
    return msg


# ---------------------------------------------------------------- streaming


class StreamEncoder:
    """Turns reply deltas into `chat.completion.chunk` SSE frames, ending with `data: [DONE]`.

    Call order: `start`, any number of `delta` (choices interleaved freely), one `finish` per
    choice, then `end`. Each returns ready frames. `error` replaces the rest of the stream.
    """

    def __init__(self, completion_id: str, model: str, created: int, *, n: int = 1,
                 include_usage: bool = False, logprobs: bool = False,
                 request: CompletionRequest | None = None) -> None:
        self.id = with_prefix(completion_id, ID_PREFIX)
        self.model, self.created, self.n = model, created, n
        self.include_usage, self.logprobs = include_usage, logprobs
        self._spoke = [False] * n  # a choice sent content or a tool call
        del request  # one constructor for all three encoders; Chat Completions echoes nothing
        # Every chunk starts with the same head: serialize it once (a frame per token adds up).
        self._frame_head = "data: " + JSON_ENCODER.encode(self._head())[:-1] + ',"choices":['

    @classmethod
    def for_request(cls, req: CompletionRequest, completion_id: str,
                    created: int) -> StreamEncoder:
        """An encoder configured from a parsed request."""
        return cls(completion_id, req.model, created, n=req.n, include_usage=req.include_usage,
                   logprobs=req.logprobs, request=req)

    def start(self, prompt_tokens: int = 0) -> list[str]:
        """One role chunk per choice, in index order (the SDK's accumulator needs that order)."""
        return [self._chunk(i, {"role": "assistant"}) for i in range(self.n)]

    def delta(self, index: int, d: ReplyDelta | None,
              logprobs: Sequence[TokenLogprob] | None = None) -> list[str]:
        """Frames for one reply delta (or only logprobs, when `d` is None)."""
        if type(d) is ContentDelta and d.text and not (logprobs and self.logprobs):
            # the common frame, written directly; equal to `_chunk(index, {"content": ...})`
            self._spoke[index] = True
            return [f'{self._frame_head}{{"index":{index},"delta":{{"content":'
                    f'{JSON_ENCODER.encode(d.text)}}},"logprobs":null,"finish_reason":null}}]}}\n\n']
        body: dict[str, Any] = {}
        if isinstance(d, ContentDelta) and d.text:
            body["content"] = d.text
        elif isinstance(d, ReasoningDelta) and d.text:
            body[REASONING_FIELD] = d.text
        elif isinstance(d, ToolCallDelta):
            body["tool_calls"] = [_tool_call_delta(d)]
        if "content" in body or "tool_calls" in body:
            self._spoke[index] = True
        lps = logprob_entries(logprobs) if logprobs and self.logprobs else None
        if not body and not lps:
            return []
        return [self._chunk(index, body, logprobs=lps)]

    def finish(self, index: int, finish_reason: ReplyFinish, interaction_id: str,
               stop_sequence: str | None = None) -> list[str]:
        """The chunk that ends choice `index`, carrying its finish reason and interaction id."""
        # an empty reply still gets content "", as the non-streamed message has
        body: dict[str, Any] = {} if self._spoke[index] else {"content": ""}
        return [self._chunk(index, body, finish=FINISH_REASONS[finish_reason],
                            interaction_id=interaction_id)]

    def end(self, prompt_tokens: int, completion_tokens: int) -> list[str]:
        """The usage chunk (when asked for) and `[DONE]`."""
        frames = []
        if self.include_usage:
            frames.append(sse({**self._head(), "choices": [],
                               "usage": usage(prompt_tokens, completion_tokens)}))
        return [*frames, "data: [DONE]\n\n"]

    def error(self, exc: BaseException) -> list[str]:
        """A mid-stream error frame (the openai SDK raises `APIError` on it)."""
        return [sse(error_body(exc))]

    def keepalive(self) -> list[str]:
        """An SSE comment: keeps proxies from closing an idle stream, ignored by clients."""
        return [": keepalive\n\n"]

    def _head(self) -> dict[str, Any]:
        head: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk",
                                "created": self.created, "model": self.model,
                                "system_fingerprint": None}
        if self.include_usage:
            head["usage"] = None
        return head

    def _chunk(self, index: int, delta: dict[str, Any], *, finish: str | None = None,
               logprobs: list[dict[str, Any]] | None = None,
               interaction_id: str | None = None) -> str:
        choice: dict[str, Any] = {
            "index": index, "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish,
        }
        if interaction_id is not None:
            choice["interaction_id"] = interaction_id  # extension: what set_reward takes
        return f"{self._frame_head}{JSON_ENCODER.encode(choice)}]}}\n\n"


def _tool_call_delta(d: ToolCallDelta) -> dict[str, Any]:
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {"index": d.index, "id": d.id, "type": "function",
            "function": {"name": d.name or "", "arguments": d.arguments}}


__all__ = [
    "DEFAULT_MAX_TOKENS",
    "FINISH_REASONS",
    "ID_PREFIX",
    "MAX_N",
    "REASONING_FIELD",
    "StreamEncoder",
    "assistant_message",
    "error_body",
    "parse_body",
    "render_completion",
    "to_request",
]
