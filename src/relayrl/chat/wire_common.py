"""What every wire format shares: body validation, sampling checks, tool checks, SSE framing,
OpenAI's error body, and `WireFormat`, the protocol each `wire_*` module satisfies.

A new wire format is one module beside `wire_openai_chat`, `wire_openai_responses` and
`wire_anthropic` that provides what `WireFormat` names, built from the helpers here; the gateway
then serves it by adding one `WireFormat` entry (see `relayrl.gateway.wires`).

May import: pydantic, `relayrl.chat.completion`, `relayrl.chat.conversation`, `relayrl.errors`,
`relayrl.types`. Never a `wire_*` module (they import this one), FastAPI, an engine or torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from relayrl.chat.completion import Completion, CompletionRequest, ReplyFinish, TokenLogprob
from relayrl.chat.conversation import ReplyDelta, Tool, ToolChoice
from relayrl.errors import ContextLengthExceeded, InvalidRequest, RelayError
from relayrl.types import SamplingParams

DEFAULT_MAX_TOKENS = 1024
"""Sampled-token budget when a request names none; the gateway may clamp it to the context."""
MAX_TOKENS_LIMIT = 1 << 20
"""Largest `max_tokens` accepted (more than any model's context): above it is a 400, below it a
budget larger than the room left in the context is clamped to that room."""
PART_SEPARATOR = "\n"
"""Joins the text parts of one list-valued content (as vLLM does)."""

M = TypeVar("M", bound=BaseModel)

# vLLM/SGLang sampling extensions we do not implement, with the value that means "off".
_UNHONOURED_EXTENSIONS: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "ignore_eos": False,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "best_of": 1,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "logits_processors": None,
}


def invalid(message: str, param: str | None = None) -> InvalidRequest:
    """An `InvalidRequest` carrying the offending field in `.param` (OpenAI's `error.param`)."""
    exc = InvalidRequest(message)
    exc.param = param  # kept in __dict__, so it still pickles
    return exc


def parse_model(model: type[M], raw: Any) -> M:
    """Validate a JSON body against a wire schema; a validation error becomes a 400."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or None
        raise invalid(f"{where or 'body'}: {err['msg']}", where) from None


JSON_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""One encoder for every frame: `json.dumps` with options builds a new one per call."""


def sse(payload: Mapping[str, Any], event: str | None = None) -> str:
    """One server-sent-event frame (`event:` line only when named)."""
    data = JSON_ENCODER.encode(payload)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


def check_extensions(extra: Mapping[str, Any]) -> None:
    """Refuse a known sampling extension that is set to anything but its neutral value."""
    for name, neutral in _UNHONOURED_EXTENSIONS.items():
        v = extra.get(name)
        if v is not None and v != neutral and v != [] and v != {}:
            raise invalid(f"{name} is not supported by this server", name)


def sampling_params(*, max_tokens: int | None, temperature: float | None, top_p: float | None,
                    top_k: int | None, stop: Sequence[str], seed: int | None, top_logprobs: int,
                    max_temperature: float = 2.0, names: Mapping[str, str] | None = None,
                    ) -> SamplingParams:
    """Check ranges and build `SamplingParams`; `names` maps our names to the wire's for errors."""
    n = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
         "top_k": "top_k", **(names or {})}
    mt = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if type(mt) is not int:  # JSON true parses as an int subclass; "10" must not pass either
        raise invalid(f"{n['max_tokens']} must be an integer, got {mt!r}", n["max_tokens"])
    if not 1 <= mt <= MAX_TOKENS_LIMIT:
        raise invalid(f"{n['max_tokens']} must be in [1, {MAX_TOKENS_LIMIT}], got {mt}",
                      n["max_tokens"])
    t = 1.0 if temperature is None else temperature
    if not 0.0 <= t <= max_temperature:
        raise invalid(f"temperature must be in [0, {max_temperature:g}], got {t}", n["temperature"])
    p = 1.0 if top_p is None else top_p
    if not 0.0 < p <= 1.0:
        raise invalid(f"top_p must be in (0, 1], got {p}", n["top_p"])
    k = 0 if top_k is None or top_k == -1 else top_k
    if k < 0:
        raise invalid(f"top_k must be -1, 0 (off) or positive, got {k}", n["top_k"])
    return SamplingParams(max_new_tokens=mt, temperature=t, top_p=p, top_k=k,
                          stop=tuple(s for s in stop if s), seed=seed, top_logprobs=top_logprobs)


def check_tools(tools: Sequence[Tool], param: str = "tools") -> None:
    """Tool names must be non-empty and unique (a template cannot tell two `f`s apart)."""
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if not t.name:
            raise invalid("a tool needs a name", f"{param}[{i}]")
        if t.name in seen:
            raise invalid(f"two tools are named {t.name!r}", f"{param}[{i}]")
        seen.add(t.name)


def check_tool_choice(choice: ToolChoice, tools: Sequence[Tool], param: str = "tool_choice") -> None:
    """A demanded or named call needs tools, and a named one must be among them."""
    if choice in ("auto", "none"):
        return
    if not tools:
        raise invalid(f"tool_choice {choice!r} needs tools, and the request lists none", param)
    if choice != "required" and choice not in {t.name for t in tools}:
        raise invalid(f"tool_choice names {choice!r}, which is not among the tools", param)


def check_parallel(parallel: bool | None, tools: Sequence[Tool], choice: ToolChoice,
                   param: str = "parallel_tool_calls") -> None:
    """We cannot stop a model from writing two calls: refuse a request that forbids it."""
    if parallel is False and tools and choice != "none":
        raise invalid("parallel_tool_calls=false is not supported: the model may write several "
                      "calls in one turn and we do not constrain decoding", param)


def with_prefix(id_: str, prefix: str) -> str:
    """`id_` with the wire's id prefix, added only once."""
    return id_ if id_.startswith(prefix) else prefix + id_


_ERROR_CODES: dict[type[BaseException], str] = {ContextLengthExceeded: "context_length_exceeded"}


def openai_error_body(exc: BaseException) -> dict[str, Any]:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    code = next((c for k, c in _ERROR_CODES.items() if isinstance(exc, k)), None)
    return {"error": {
        "message": str(exc) or type(exc).__name__,
        "type": exc.error_type if isinstance(exc, RelayError) else "api_error",
        "param": getattr(exc, "param", None),
        "code": code,
    }}


def join_text(parts: Sequence[str]) -> str:
    """Join the text parts of one message."""
    return PART_SEPARATOR.join(parts)


class StreamEncoder(Protocol):
    """Turns one completion's reply deltas into the wire's server-sent events."""

    def start(self, prompt_tokens: int = 0) -> list[str]:
        """Frames that open the stream."""
        ...

    def delta(self, index: int, d: ReplyDelta | None,
              logprobs: Sequence[TokenLogprob] | None = None) -> list[str]:
        """Frames for one delta of choice `index` (and the logprobs of its tokens)."""
        ...

    def finish(self, index: int, finish_reason: ReplyFinish, interaction_id: str,
               stop_sequence: str | None = None) -> list[str]:
        """Frames that close choice `index`."""
        ...

    def error(self, exc: BaseException) -> list[str]:
        """Frames that report an error mid-stream."""
        ...

    def end(self, prompt_tokens: int, completion_tokens: int) -> list[str]:
        """Frames that close the stream (usage included where the wire carries it)."""
        ...


class StreamEncoderFactory(Protocol):
    """The `StreamEncoder` class of a wire module."""

    def for_request(self, req: CompletionRequest, completion_id: str,
                    created: int) -> StreamEncoder:
        """An encoder for one streamed call."""
        ...


class WireFormat(Protocol):
    """One wire format: what a `relayrl.chat.wire_*` module provides (modules satisfy it)."""

    ID_PREFIX: str
    """Prefix of reply ids on this wire (`chatcmpl-`, `resp_`, `msg_`); the call id follows."""

    @property
    def StreamEncoder(self) -> StreamEncoderFactory:  # the module's class name
        """The stream encoder class."""
        ...

    def parse_body(self, raw: Any) -> Any:
        """Validate a JSON body as this wire's request model (a 400 when malformed)."""
        ...

    def to_request(self, body: Any) -> CompletionRequest:
        """The validated request as the gateway's `CompletionRequest`."""
        ...

    def render_completion(self, c: Completion,
                          request: CompletionRequest | None = None) -> dict[str, Any]:
        """A finished completion as this wire's JSON reply."""
        ...

    def error_body(self, exc: BaseException) -> dict[str, Any]:
        """An error as this wire's JSON error body."""
        ...
