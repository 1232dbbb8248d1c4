"""`FakeEngine`: scripted replies with a real tokenizer, for fast tests of everything above the engine.

It speaks the `InferenceEngine` protocol exactly (validation, streaming token by token, stop ids
and strings, `max_new_tokens`, context length, versions, weight updates, abort on close) but its
"model" is a script: the next reply text (or ids) per request. Text is encoded with the model's
real `tokenizer.json` through the `tokenizers` package, so ids, detokenization and stop strings
behave as they will with a real engine; logprobs are deterministic pseudo-values.

Tradeoff: no torch and no transformers import (the gateway must import without them), so it
cannot render chat templates or compute real logprobs; it is built to be fast enough that a
gateway benchmark through it measures the gateway, not the fake.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from relayrl.engine.base import validate_request
from relayrl.engine.stops import StopStringMatcher
from relayrl.errors import EngineError, InvalidRequest
from relayrl.types import (
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    Timings,
    TokenChunk,
    TopLogprob,
)

Script = Callable[[GenerateRequest], str | list[int]] | Sequence[str]

DEFAULT_REPLY = "ok"
_BYTE_VOCAB = 257
"""Without a tokenizer, ids 0-255 are UTF-8 bytes and 256 is the end-of-turn id."""
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>")
"""Tried in order when no eos id is given and the tokenizer config names none."""
_ENCODE_CACHE = 4096
"""Distinct reply texts whose ids are kept (benchmarks repeat a few replies many times)."""


class FakeEngine:
    """An `InferenceEngine` whose replies come from a script (see the module docstring).

    `script` is a callable (request -> text or ids), a sequence of texts used in turn (cycling
    when exhausted), or None for the constant reply "ok". Every reply gets `eos_token_id`
    appended (when known) unless it already ends with it; the reply's end finishes with "stop".
    """

    def __init__(
        self,
        script: Script | None = None,
        *,
        tokenizer_path: str | None = None,
        vocab_size: int | None = None,
        context_length: int = 8192,
        eos_token_id: int | None = None,
        token_delay_s: float = 0.0,
    ) -> None:
        self.tokenizer = _load_tokenizer(tokenizer_path) if tokenizer_path else None
        if self.tokenizer is not None:
            natural_vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
            eos = (
                eos_token_id
                if eos_token_id is not None
                else _find_eos(self.tokenizer, tokenizer_path)
            )
        else:
            natural_vocab, eos = _BYTE_VOCAB, eos_token_id if eos_token_id is not None else 256
        self.vocab_size = vocab_size if vocab_size is not None else natural_vocab
        self.eos_token_id = eos
        self.token_delay_s = token_delay_s
        self._context_length = context_length
        self._script = _as_callable(script)
        self._encoded: dict[str, list[int]] = {}
        self._version = 0
        self._closed = False
        self.requests: collections.deque[GenerateRequest] = collections.deque(maxlen=1024)
        """The most recent requests, newest last (for assertions in tests)."""

    @property
    def version(self) -> int:
        """Weight version that samples the next token."""
        return self._version

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + output) one sequence may hold."""
        return self._context_length

    def encode(self, text: str) -> list[int]:
        """Ids of `text` (no special tokens added), as the fake's tokenizer splits it."""
        ids = self._encoded.get(text)
        if ids is None:
            if self.tokenizer is not None:
                ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            else:
                ids = list(text.encode())
            if len(self._encoded) < _ENCODE_CACHE:
                self._encoded[text] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens included."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Produce the whole scripted reply."""
        if self.token_delay_s > 0:  # tokens arrive over time: an update or close can land between
            return GenerateOutput.from_chunks([c async for c in self.stream(request)])
        start = time.perf_counter()
        # Built in one piece, as the stream would end up: a benchmark of the gateway measures
        # the gateway, not thirty chunk objects and an async generator per call (a fifth of a
        # short call's server time when the fake streamed its whole reply).
        plan = _Plan.of(request, self._accept(request), self._context_length, self.vocab_size,
                        self.decode)
        return GenerateOutput(output_ids=plan.ids, logprobs=plan.logprobs,
                              versions=[self._version] * len(plan.ids),
                              finish_reason=plan.finish, timings=_timings(start),
                              top_logprobs=plan.tops, stop_string=plan.stop_string)

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Produce the scripted reply token by token; bad requests raise here."""
        return self._stream(request, self._accept(request))

    def _accept(self, request: GenerateRequest) -> list[int]:
        """Check and note a request; the reply ids it will get."""
        validate_request(request, self._context_length, self.vocab_size)
        if self._closed:
            raise EngineError("the engine is closed")
        self.requests.append(request)
        return self._reply_ids(request)

    async def update_weights(
        self, weights: Mapping[str, Any] | str, version: int | None = None
    ) -> int:
        """Accept anything; bump the version (or set it to `version`)."""
        if self._closed:
            raise EngineError("the engine is closed")
        self._version = version if version is not None else self._version + 1
        return self._version

    async def aclose(self) -> None:
        """Stop serving; streams in flight end with `abort` at their next token."""
        self._closed = True

    def _reply_ids(self, request: GenerateRequest) -> list[int]:
        reply = self._script(request)
        ids = self.encode(reply) if isinstance(reply, str) else list(reply)
        eos = self.eos_token_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"scripted reply holds id {bad[0]}, outside the vocabulary")
        return ids

    async def _stream(
        self, request: GenerateRequest, reply: list[int]
    ) -> AsyncIterator[TokenChunk]:
        start = time.perf_counter()
        plan = _Plan.of(request, reply, self._context_length, self.vocab_size, self.decode)
        if not plan.ids:
            yield TokenChunk([], [], [], finish_reason=plan.finish, timings=_timings(start))
            return
        last = len(plan.ids) - 1
        for i, token in enumerate(plan.ids):
            if self.token_delay_s > 0:
                await asyncio.sleep(self.token_delay_s)
            if self._closed:
                yield TokenChunk(
                    [], [], [], finish_reason=FinishReason.ABORT, timings=_timings(start)
                )
                return
            yield TokenChunk(
                ids=[token],
                logprobs=[plan.logprobs[i]],
                versions=[self._version],
                top_logprobs=None if plan.tops is None else [plan.tops[i]],
                finish_reason=plan.finish if i == last else None,
                stop_string=plan.stop_string if i == last else None,
                timings=_timings(start) if i == last else None,
            )


@dataclass
class _Plan:
    """The tokens a request gets from a scripted reply, and how it ends."""

    ids: list[int]
    logprobs: list[float]
    tops: list[list[TopLogprob]] | None
    finish: FinishReason
    stop_string: str | None

    @classmethod
    def of(cls, request: GenerateRequest, reply: list[int], context_length: int, vocab: int,
           decode: Callable[[list[int]], str]) -> _Plan:
        """Cut `reply` where the request's budget, stop ids or stop strings end it."""
        p = request.params
        budget = min(p.max_new_tokens, context_length - len(request.prompt_ids))
        if not p.stop and p.top_logprobs <= 0 and budget > 0:
            return cls._without_stop_strings(reply, budget, p.stop_token_ids)
        matcher = StopStringMatcher(p.stop, decode) if p.stop else None
        stop_ids = set(p.stop_token_ids)
        plan = cls([], [], [] if p.top_logprobs > 0 else None, FinishReason.STOP, None)
        for token in reply[:budget]:
            plan.ids.append(token)
            finish, plan.stop_string = _finish(token, plan.ids, len(reply), budget, stop_ids,
                                               matcher)
            logprob = pseudo_logprob(len(plan.ids) - 1, token)
            plan.logprobs.append(logprob)
            if plan.tops is not None:
                plan.tops += _tops(token, logprob, p.top_logprobs, vocab) or []
            if finish is not None:
                plan.finish = finish
                break
        return plan

    @classmethod
    def _without_stop_strings(cls, reply: list[int], budget: int,
                              stop_token_ids: Sequence[int]) -> _Plan:
        """`of` when no stop string and no top logprobs are asked for: the same plan, cut in
        one pass instead of token by token (a gateway benchmark pays this on every call)."""
        ids = reply[:budget]
        stop_ids = set(stop_token_ids)
        finish = FinishReason.STOP if len(reply) <= budget else FinishReason.LENGTH
        if not stop_ids.isdisjoint(ids):
            ids = ids[:next(i for i, t in enumerate(ids) if t in stop_ids) + 1]
            finish = FinishReason.STOP
        key = tuple(ids)
        logprobs = _LOGPROBS.get(key)
        if logprobs is None:
            logprobs = [pseudo_logprob(i, t) for i, t in enumerate(ids)]
            if len(_LOGPROBS) < _ENCODE_CACHE:
                _LOGPROBS[key] = logprobs
        return cls(ids, list(logprobs), None, finish, None)


_LOGPROBS: dict[tuple[int, ...], list[float]] = {}
"""Pseudo-logprobs of replies already planned (benchmarks send a few replies many times)."""


def pseudo_logprob(position: int, token: int) -> float:
    """A deterministic negative number standing in for a logprob."""
    # Knuth's multiplicative hash spreads consecutive inputs over (-2.01, -0.01].
    h = ((position + 1) * 2654435761 ^ token * 40503) % 1000
    return -0.01 - h / 500


def _finish(
    token: int,
    out: list[int],
    reply_len: int,
    budget: int,
    stop_ids: set[int],
    matcher: StopStringMatcher | None,
) -> tuple[FinishReason | None, str | None]:
    if token in stop_ids:
        return FinishReason.STOP, None
    if matcher is not None and (hit := matcher.match(out)) is not None:
        return FinishReason.STOP, hit
    if len(out) >= reply_len:
        return FinishReason.STOP, None
    if len(out) >= budget:
        return FinishReason.LENGTH, None
    return None, None


def _tops(token: int, logprob: float, n: int, vocab: int) -> list[list[TopLogprob]] | None:
    if n <= 0:
        return None
    # The sampled token leads; made-up alternatives follow with lower logprobs.
    return [[TopLogprob((token + j) % vocab, logprob - j) for j in range(min(n, vocab))]]


def _timings(start: float) -> Timings:
    total = time.perf_counter() - start
    return Timings(queued_s=0.0, first_token_s=total, total_s=total)


def _as_callable(script: Script | None) -> Callable[[GenerateRequest], str | list[int]]:
    if script is None:
        return lambda request: DEFAULT_REPLY
    if callable(script):
        return script
    if isinstance(script, str):
        raise InvalidRequest("script must be a callable or a sequence of replies, not one string")
    replies = list(script)
    if not replies:
        raise InvalidRequest("script has no replies")
    turns = itertools.cycle(replies)
    return lambda request: next(turns)


def _load_tokenizer(path: str) -> Tokenizer:
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise InvalidRequest(f"no tokenizer.json at {path!r}")
    return Tokenizer.from_file(str(file))


def _find_eos(tokenizer: Tokenizer, path: str | None) -> int | None:
    """The end-of-turn id: the tokenizer config's eos_token, else a well-known end token."""
    names: list[str] = []
    config = Path(path or "") / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.append(eos)
    for name in (*names, *_END_TOKENS):
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    return None
