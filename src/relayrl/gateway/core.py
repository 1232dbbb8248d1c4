"""The one completion path behind all three front doors.

parse (done by the route) → locate the parent call in the session → build the prompt (extend the
parent's exact tokens, or render a new segment) → sample with the engine → parse the output →
record the call (memory + durable log) → hand a `Completion` (or a stream of deltas) back to the
route, which renders it in its own wire format.

Nothing here knows a wire format. The main tradeoff: the prompt of a continuing call is built from
the parent's stored token ids, never from re-rendered text, so what the engine saw is exactly what
the trainer gets; the price is that an agent which edits its history opens a new segment.
A conversation that does render (a first call, a GRPO group's shared prompt) goes through a small
exact-match `RenderCache`, since the same prompt is sent many times.

May import: `relayrl.chat`, `relayrl.engine.base` (the protocol), `relayrl.trajectory`,
`relayrl.types`, `relayrl.errors`, `gateway.config`, `gateway.idempotency` and
`gateway.session_store`; no FastAPI (the routes are in `app` and `routes_rl`), no torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Hashable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from relayrl.chat.completion import Choice, Completion, CompletionRequest, ReplyFinish, TokenLogprob
from relayrl.chat.conversation import Conversation, ParsedReply, ReplyDelta
from relayrl.chat.detokenize import IncrementalDecoder
from relayrl.chat.parsers import StreamingReplyParser, parse_reply, prompt_opens_reasoning
from relayrl.chat.renderer import Renderer
from relayrl.engine.base import InferenceEngine
from relayrl.errors import ContextLengthExceeded, InvalidRequest, RelayError
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.idempotency import IdempotencyCache
from relayrl.gateway.session_store import SessionStore
from relayrl.trajectory import AbortedCall, BranchReason, Interaction, InteractionLog, Session
from relayrl.trajectory.links import REQUEST_LINK_KEY, LinkSignal
from relayrl.types import FinishReason, GenerateOutput, GenerateRequest, TokenChunk

log = logging.getLogger("relayrl.gateway")

TOOL_CALL_OPEN = "<tool_call>\n"
"""Hermes/Qwen tool-call opening, used to force a call when `tool_choice` demands one."""


RENDER_CACHE_TOKENS = 1 << 18
"""Prompt tokens the render cache keeps (262k: about 10 MB of ids, plus the keys' text)."""
RENDER_CACHE_ENTRIES = 4096
"""Most conversations the render cache keeps, however short."""


class RenderCache:
    """Prompt ids of recently rendered conversations, keyed by exactly what renders (LRU).

    GRPO sends each prompt `group_size` times and agents retry calls, so the same conversation is
    rendered again and again; a hit skips the chat template and the tokenizer. The key holds every
    field the template reads, verbatim (unlike the session's forgiving hash), so a hit is always
    the ids a fresh render gives. A conversation that misses but whose head (everything up to its
    last assistant turn) was rendered before, as when a client re-sends a long history with a new
    last turn outside a session's parent chain, renders and encodes only the turns after the head
    (`Renderer.render_after_head`, for templates that render locally). The tradeoffs: a miss that
    may become a head costs a second, split encode; building a key costs a tuple per message (each
    message keeps its own, `Message.verbatim_key`); the cache holds references to the keys' text.
    """

    def __init__(self, max_tokens: int = RENDER_CACHE_TOKENS,
                 max_entries: int = RENDER_CACHE_ENTRIES) -> None:
        self._ids: OrderedDict[Hashable, tuple[int, ...]] = OrderedDict()
        self._tokens = 0
        self.max_tokens, self.max_entries = max_tokens, max_entries
        self.hits = 0
        self.misses = 0
        self.head_hits = 0
        """Misses served from a cached head (the turns after it rendered and encoded alone)."""

    def render(self, renderer: Renderer, conv: Conversation) -> list[int]:
        """`renderer.render(conv)`, from the cache when this exact conversation was rendered, or
        from the cached ids of everything up to its last assistant turn (its head)."""
        if not renderer.deterministic:
            return renderer.render(conv)
        key = render_key(conv)
        ids = self.get(key)
        if ids is not None:
            return ids
        head = last_assistant_turn(conv)
        head_key: Hashable = None
        if head >= HEAD_MIN_MESSAGES:
            head_key = ("head", key[0][:head], key[1], key[2])
            head_ids = self._ids.get(head_key)
            if head_ids is not None:
                fresh = renderer.render_after_head(head_ids, conv, head)
                if fresh is not None:
                    self._ids.move_to_end(head_key)
                    self.head_hits += 1
                    self.put(key, fresh)
                    return fresh
        fresh, head_len = renderer.render_with_head(conv, head) if head_key else (
            renderer.render(conv), None)
        self.put(key, fresh)
        if head_len is not None:
            self.put(head_key, fresh[:head_len])
        return fresh

    def get(self, key: Hashable) -> list[int] | None:
        """The ids cached under `key` (a `render_key`), counting the hit or miss."""
        ids = self._ids.get(key)
        if ids is None:
            self.misses += 1
            return None
        self._ids.move_to_end(key)
        self.hits += 1
        return list(ids)

    def put(self, key: Hashable, ids: Sequence[int]) -> None:
        """Cache `ids` under `key`, evicting the least recently used beyond the bounds."""
        if key in self._ids:  # two calls rendered the same prompt at once
            return
        self._ids[key] = tuple(ids)
        self._tokens += len(ids)
        for _ in range(len(self._ids)):  # evict least recently used until within both bounds
            if self._tokens <= self.max_tokens and len(self._ids) <= self.max_entries:
                break
            _, old = self._ids.popitem(last=False)
            self._tokens -= len(old)

    def clear(self) -> None:
        """Forget every cached prompt (hit and miss counts stay)."""
        self._ids.clear()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._ids)


HEAD_MIN_MESSAGES = 4
"""Shortest head (messages up to the last assistant turn) worth caching apart: rendering a
shorter one costs about what splitting it off does."""


def last_assistant_turn(conv: Conversation) -> int:
    """How many messages of `conv` run up to and including its last assistant turn (0: none)."""
    messages = conv.messages
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "assistant":
            return i + 1
    return 0


RenderKey = tuple[tuple[tuple[Any, ...], ...], tuple[tuple[str, str, str], ...], str]
"""`render_key`'s value: the messages' verbatim keys, the tools, the template kwargs."""


def render_key(conv: Conversation) -> RenderKey:
    """Everything a chat template reads from `conv`, verbatim, as a hashable value."""
    messages = tuple([m.verbatim_key for m in conv.messages])
    # json without sort_keys: key order and 1 vs 1.0 vs true reach the template, so they count
    tools = tuple((t.name, t.description, json.dumps(t.parameters, default=str))
                  for t in conv.rendered_tools())
    kwargs = json.dumps(conv.template_kwargs, default=str) if conv.template_kwargs else ""
    return messages, tools, kwargs


@dataclass
class GatewayDeps:
    """Everything the routes need, stored on `app.state.deps` (no module-level state)."""

    config: GatewayConfig
    renderer: Renderer
    engine: InferenceEngine
    store: SessionStore
    log: InteractionLog | None = None
    model_label: str = "default"
    started: float = field(default_factory=time.time)
    warned_fields: set[str] = field(default_factory=set)
    """Unknown request fields already logged once."""
    renders: RenderCache = field(default_factory=RenderCache)
    """Prompt ids of recently rendered conversations."""
    announced_version: int = 0
    """The version an external trainer says it pushed to the engine (`/rl/v1/set_version`)."""
    idempotency: IdempotencyCache = field(default_factory=IdempotencyCache)
    """Answers kept for calls retried with an `Idempotency-Key`."""
    opens_reasoning: dict[tuple[int, ...], bool] = field(default_factory=dict)
    """Whether a prompt ending (its last 8 ids) opens reasoning (`_opens_reasoning`)."""
    owns_engine: bool = False
    """The engine was made for this gateway (`build_deps` without one): the app closes it when it
    shuts down. An engine passed in stays its owner's to close (the trainer keeps using it)."""

    @property
    def policy_version(self) -> int:
        """The version the staleness rule counts from: the engine's, or a later announced one."""
        return max(self.engine.version, self.announced_version)


@dataclass(frozen=True)
class PreparedCall:
    """A request turned into token ids, with where it sits in the session tree."""

    request: CompletionRequest
    prompt_ids: list[int]
    forced_prefix: str
    """Text put into the prompt to force a tool call (empty when none); the parser sees it first."""
    parent: Interaction | None
    segment_reason: BranchReason | None
    params_max_tokens: int
    interaction_ids: tuple[str, ...]
    """One id per choice, fixed before sampling so a stream can name its call up front."""
    starts_in_reasoning: bool
    """The prompt opened a `<think>` block (templates that start replies inside reasoning)."""
    link_rule: str | None = None
    """For a compaction or sub-agent segment: the rule that linked it (`trajectory.links`)."""


OFFLOAD_CHARS = 32_768
"""Prompts with more text than this are tokenized in a worker thread, off the event loop."""


def prompt_chars(conv: Conversation) -> int:
    """Characters of message text in `conv`: every one of them is in the prompt."""
    n = 0
    for m in conv.messages:
        n += len(m.content) + len(m.reasoning or "")
        for c in m.tool_calls:
            n += len(c.arguments)
    return n


def check_size(deps: GatewayDeps, req: CompletionRequest) -> int:
    """Refuse, before any tokenizing, a call that cannot fit the context; return its text size.

    No token spells more than `renderer.max_token_chars` characters, so a prompt with more than
    that many times the context's length in characters is over the context whatever it says.
    """
    context = deps.engine.context_length
    chars = prompt_chars(req.conversation)
    if chars > context * deps.renderer.max_token_chars:
        raise ContextLengthExceeded(
            f"the prompt is {chars} characters, more than this model's context of {context} "
            "tokens can hold"
        )
    return chars


async def prepare_async(deps: GatewayDeps, session: Session | None,
                        req: CompletionRequest) -> PreparedCall:
    """`prepare`, after `check_size`, with a long prompt tokenized in a worker thread."""
    if check_size(deps, req) <= OFFLOAD_CHARS:
        return prepare(deps, session, req)
    # The session tree and the render cache are read here, on the loop (a call may be recorded
    # meanwhile); only the render and tokenizing (which releases the GIL) run in the thread.
    conv = req.conversation
    _check_tool_choice(conv)
    parent, reason, rule = _locate_linked(session, req)
    if (parent is None or reason is not None) and deps.renderer.deterministic:
        key = render_key(conv)  # a GRPO group sends a long prompt many times: render it once
        rendered = deps.renders.get(key)
        if rendered is None:
            rendered = await asyncio.to_thread(deps.renderer.render, conv)
            deps.renders.put(key, rendered)
        prompt = rendered
    else:
        prompt, reason = await asyncio.to_thread(_build_prompt, deps, conv, parent, reason, False)
    return _finish_prepare(deps, req, prompt, parent, reason, rule)


def _locate(session: Session | None,
            conv: Conversation) -> tuple[Interaction | None, BranchReason | None]:
    if session is None:
        return None, None
    located = session.locate(conv)
    return located.parent, located.reason


def _locate_linked(session: Session | None, req: CompletionRequest
                   ) -> tuple[Interaction | None, BranchReason | None, str | None]:
    """`_locate`, with the request's explicit link signal and the rule that linked a segment."""
    if session is None:
        return None, None, None
    raw = req.metadata.get(REQUEST_LINK_KEY)
    signal = LinkSignal.from_dict(raw) if isinstance(raw, dict) else None
    located = session.locate(req.conversation, signal)
    return located.parent, located.reason, located.link_rule


def _build_prompt(deps: GatewayDeps, conv: Conversation, parent: Interaction | None,
                  reason: BranchReason | None,
                  cached: bool) -> tuple[list[int], BranchReason | None]:
    prompt = None
    if parent is not None and reason is None:
        prev_ids = [*parent.prompt_ids, *parent.output_ids]
        prev_messages = (*parent.conversation.messages, parent.reply.to_message())
        prompt = deps.renderer.extend(prev_ids, prev_messages, conv)
        if prompt is None:  # the tree link stays, so credit still flows to the parent
            reason = BranchReason.PROMPT_MISMATCH
    if prompt is None:
        prompt = (deps.renders.render(deps.renderer, conv) if cached
                  else deps.renderer.render(conv))
    return prompt, reason


def prepare(deps: GatewayDeps, session: Session | None, req: CompletionRequest) -> PreparedCall:
    """Build the prompt ids for a call: extend the parent's tokens, or render a new segment."""
    conv = req.conversation
    _check_tool_choice(conv)
    parent, reason, rule = _locate_linked(session, req)
    prompt, reason = _build_prompt(deps, conv, parent, reason, True)
    return _finish_prepare(deps, req, prompt, parent, reason, rule)


def _finish_prepare(deps: GatewayDeps, req: CompletionRequest, prompt: list[int],
                    parent: Interaction | None, reason: BranchReason | None,
                    link_rule: str | None) -> PreparedCall:
    forced = _forced_prefix(req.conversation)
    if forced:
        prompt = prompt + deps.renderer.encode(forced)
    room = deps.engine.context_length - len(prompt)
    if room <= 0:
        raise ContextLengthExceeded(
            f"the prompt is {len(prompt)} tokens; this model's context is "
            f"{deps.engine.context_length} tokens"
        )
    max_tokens = min(req.params.max_new_tokens, room)
    opens = _opens_reasoning(deps, prompt)
    ids = tuple(uuid.uuid4().hex for _ in range(req.n))
    return PreparedCall(req, prompt, forced, parent, reason, max_tokens, ids, opens, link_rule)


OPENS_CACHE_ENTRIES = 256
"""Prompt endings whose answer `_opens_reasoning` keeps (a template ends nearly every prompt
with the same few tokens)."""


def _opens_reasoning(deps: GatewayDeps, prompt: list[int]) -> bool:
    """Whether the prompt's last tokens open a `<think>` block, decoded once per ending."""
    tail = tuple(prompt[-8:])
    opens = deps.opens_reasoning.get(tail)
    if opens is None:
        opens = prompt_opens_reasoning(deps.renderer.decode(tail))
        if len(deps.opens_reasoning) >= OPENS_CACHE_ENTRIES:
            deps.opens_reasoning.clear()
        deps.opens_reasoning[tail] = opens
    return opens


def _check_tool_choice(conv: Conversation) -> None:
    choice = conv.tool_choice
    if choice in ("auto", "none"):
        return
    if not conv.tools:
        raise InvalidRequest(f"tool_choice {choice!r} needs tools, and the request lists none")
    if choice != "required" and choice not in {t.name for t in conv.tools}:
        raise InvalidRequest(f"tool_choice names {choice!r}, which is not among the tools")


def _forced_prefix(conv: Conversation) -> str:
    # We cannot constrain decoding, so a demanded call is started in the prompt: those tokens are
    # prompt tokens (not sampled, not trained on), and the parser reads them before the output.
    if conv.tool_choice == "required":
        return TOOL_CALL_OPEN
    if conv.tool_choice not in ("auto", "none"):
        return TOOL_CALL_OPEN + '{"name": "' + conv.tool_choice + '", "arguments": '
    return ""


def _engine_request(deps: GatewayDeps, call: PreparedCall, index: int) -> GenerateRequest:
    p = call.request.params
    seed = None if p.seed is None else p.seed + index
    stop_ids = tuple(dict.fromkeys((*deps.renderer.stop_token_ids, *p.stop_token_ids)))
    params = replace(p, max_new_tokens=call.params_max_tokens, stop_token_ids=stop_ids, seed=seed)
    # rendered by the tokenizer, or the parent's prompt and sampled output: in the vocabulary
    return GenerateRequest(prompt_ids=call.prompt_ids, params=params, tokenizer_ids=True)


def visible_text(deps: GatewayDeps, out: GenerateOutput) -> str:
    """The output as text: no end-of-turn token, cut at the stop string that ended it."""
    ids = out.output_ids
    if out.finish_reason == FinishReason.STOP and ids and ids[-1] in deps.renderer.stop_token_ids:
        ids = ids[:-1]
    text = deps.renderer.decode(ids)
    if out.stop_string:
        cut = text.find(out.stop_string)
        if cut >= 0:
            text = text[:cut]
    return text


def reply_finish(out: GenerateOutput, reply: ParsedReply) -> ReplyFinish:
    """Wire-neutral finish reason of one sampled reply."""
    if out.finish_reason == FinishReason.ABORT:
        return "abort"
    if out.finish_reason == FinishReason.LENGTH:
        return "length"
    return "tool_calls" if reply.tool_calls else "stop"


def _token_logprobs(deps: GatewayDeps, out: GenerateOutput) -> tuple[TokenLogprob, ...]:
    strings = deps.renderer.token_strings(out.output_ids)
    tops = out.top_logprobs or [[] for _ in out.output_ids]
    result = []
    for s, lp, top in zip(strings, out.logprobs, tops, strict=True):
        alts = tuple(zip(deps.renderer.token_strings([t.token_id for t in top]),
                         (t.logprob for t in top), strict=True))
        result.append(TokenLogprob(token=s, logprob=lp, top=alts))
    return tuple(result)


def record(deps: GatewayDeps, session: Session | None, call: PreparedCall, index: int,
           out: GenerateOutput, reply: ParsedReply, finish: ReplyFinish) -> str:
    """Store one sampled reply in its session and the durable log; return its interaction id."""
    iid = call.interaction_ids[index]
    if session is None:
        return iid
    interaction = session.new_interaction(
        id=iid,
        parent=call.parent,
        reason=call.segment_reason,
        conversation=call.request.conversation,
        reply=reply,
        prompt_ids=tuple(call.prompt_ids),
        output=out,
        finish_reason=finish,
        metadata=call.request.metadata,
        role=call.request.role,
        link_rule=call.link_rule,
    )
    session.record(interaction)  # journaled to the durable log before memory changes
    return iid


CLIENT_DISCONNECTED = "client_disconnected"
"""`AbortedCall.reason` of a call whose client left before the answer was out."""


def record_aborted(deps: GatewayDeps, session: Session | None, call: PreparedCall, index: int,
                   output_tokens: int | None, reason: str = CLIENT_DISCONNECTED) -> None:
    """Note in the session that choice `index` of `call` was cut off (never raises)."""
    if session is None or session.state not in ("open", "ended"):
        return  # unrecorded, or closed meanwhile: nothing to add to
    try:
        session.record_aborted(AbortedCall(
            id=call.interaction_ids[index], session_id=session.id,
            parent_id=None if call.parent is None else call.parent.id,
            prompt_tokens=len(call.prompt_ids), output_tokens=output_tokens, reason=reason,
            created=time.time()))
    except RelayError as exc:  # runs while a call is being torn down: report, never raise
        log.warning("could not record an aborted call: %s", exc)


async def complete(deps: GatewayDeps, session: Session | None, req: CompletionRequest,
                   call: PreparedCall | None = None) -> Completion:
    """Serve a non-streamed call: n samples, parsed, recorded (`call`: already prepared)."""
    if call is None:
        call = prepare(deps, session, req)
    try:
        if req.n == 1:  # no gather: it would wrap the one call in a task of its own
            outs = [await deps.engine.generate(_engine_request(deps, call, 0))]
        else:
            outs = await asyncio.gather(
                *(deps.engine.generate(_engine_request(deps, call, i)) for i in range(req.n))
            )
    except asyncio.CancelledError:  # the client left (or the server stops): nobody gets it
        for i in range(req.n):
            record_aborted(deps, session, call, i, None)
        raise
    choices = []
    for i, out in enumerate(outs):
        reply = parse_reply(call.forced_prefix + visible_text(deps, out), call.starts_in_reasoning)
        finish = reply_finish(out, reply)
        iid = record(deps, session, call, i, out, reply, finish)
        lps = _token_logprobs(deps, out) if req.logprobs else None
        choices.append(Choice(index=i, reply=reply, finish_reason=finish, interaction_id=iid,
                              logprobs=lps, output_tokens=len(out.output_ids),
                              stop_sequence=out.stop_string))
    # the reply's id is its (first) call's id, so set_reward can take it (the `/rl/v1` session API)
    return Completion(id=call.interaction_ids[0], model=deps.model_label,
                      created=int(time.time()), choices=tuple(choices),
                      prompt_tokens=len(call.prompt_ids))


@dataclass(frozen=True)
class StreamDelta:
    """Reply pieces produced by one engine chunk of choice `index`."""

    index: int
    deltas: Sequence[ReplyDelta]
    logprobs: Sequence[TokenLogprob] | None = None


@dataclass(frozen=True)
class StreamFinish:
    """The end of choice `index`, after it was recorded."""

    index: int
    finish_reason: ReplyFinish
    interaction_id: str
    reply: ParsedReply
    output_tokens: int
    stop_sequence: str | None = None


StreamEvent = StreamDelta | StreamFinish


class _ChoiceStream:
    """Turns engine chunks of one choice into reply deltas, holding back a possible stop string."""

    def __init__(self, deps: GatewayDeps, call: PreparedCall, index: int) -> None:
        self.deps, self.call, self.index = deps, call, index
        self.decoder = IncrementalDecoder(deps.renderer)
        self.parser = StreamingReplyParser(starts_in_reasoning=call.starts_in_reasoning)
        self.chunks: list[TokenChunk] = []
        self.stop_ids = frozenset(deps.renderer.stop_token_ids)
        self.stops = call.request.params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.seen = ""   # all decoded text
        self.fed = 0     # how much of it the parser has had (the rest may hold a stop string)
        self.done = False
        self.sampled = 0  # output tokens received so far

    def start(self) -> list[ReplyDelta]:
        return self.parser.feed(self.call.forced_prefix) if self.call.forced_prefix else []

    def push(self, chunk: TokenChunk) -> StreamDelta:
        self.chunks.append(chunk)
        self.sampled += len(chunk.ids)
        stop_ids = self.stop_ids
        ids = chunk.ids if stop_ids.isdisjoint(chunk.ids) else [
            t for t in chunk.ids if t not in stop_ids]
        self.seen += self.decoder.push(ids)
        out: list[ReplyDelta] = []
        if chunk.finish_reason is None:
            ready = len(self.seen) - self.hold if self.stops else len(self.seen)
            if ready > self.fed:
                out = self.parser.feed(self.seen[self.fed:ready])
                self.fed = ready
        lps = None
        if self.call.request.logprobs and chunk.ids:
            partial = GenerateOutput(chunk.ids, chunk.logprobs, chunk.versions, FinishReason.STOP,
                                     top_logprobs=chunk.top_logprobs)
            lps = _token_logprobs(self.deps, partial)
        return StreamDelta(self.index, out, lps)

    def finish(self, session: Session | None) -> tuple[StreamDelta, StreamFinish]:
        self.done = True
        out = GenerateOutput.from_chunks(self.chunks)
        full = self.seen + self.decoder.flush()
        if out.stop_string and (cut := full.find(out.stop_string)) >= 0:
            full = full[: max(cut, self.fed)]
        tail = full[self.fed:]
        deltas = [*self.parser.feed(tail), *self.parser.finish()] if tail else self.parser.finish()
        reply = self.parser.result()
        finish = reply_finish(out, reply)
        iid = record(self.deps, session, self.call, self.index, out, reply, finish)
        return (StreamDelta(self.index, deltas),
                StreamFinish(self.index, finish, iid, reply, len(out.output_ids), out.stop_string))


def _merge_ready(items: list[tuple[int, TokenChunk | BaseException | None]]
                 ) -> list[tuple[int, TokenChunk | BaseException | None]]:
    """Consecutive chunks of one choice as one chunk (its tokens in order, its last finish).

    Per-token work (decoding, parsing, a JSON frame, a write) costs about as much as the rest of
    a short streamed call; tokens that are ready together are sent together, as a slower client
    would have read them anyway.
    """
    runs: list[tuple[int, list[TokenChunk] | BaseException | None]] = []
    for i, item in items:
        if isinstance(item, TokenChunk):
            last = runs[-1] if runs else None
            if (last is not None and last[0] == i and isinstance(last[1], list)
                    and last[1][-1].finish_reason is None
                    and (last[1][-1].top_logprobs is None) == (item.top_logprobs is None)):
                last[1].append(item)
            else:
                runs.append((i, [item]))
        else:
            runs.append((i, item))
    return [(i, _joined(run) if isinstance(run, list) else run) for i, run in runs]


def _joined(run: list[TokenChunk]) -> TokenChunk:
    """One chunk holding a run's tokens (built once: a run can be a whole reply)."""
    if len(run) == 1:
        return run[0]
    last = run[-1]
    return TokenChunk(
        ids=[t for c in run for t in c.ids],
        logprobs=[x for c in run for x in c.logprobs],
        versions=[v for c in run for v in c.versions],
        top_logprobs=None if last.top_logprobs is None else [
            t for c in run for t in (c.top_logprobs or [])],
        finish_reason=last.finish_reason, stop_string=last.stop_string, timings=last.timings)


async def complete_stream_batches(
    deps: GatewayDeps, session: Session | None, call: PreparedCall
) -> AsyncGenerator[list[StreamEvent], None]:
    """Serve a streamed call as batches: every event the engine has made ready, in order.

    A batch is what a route can send in one write: when the engine hands over several chunks
    before the route gets to run (a fast engine, or n > 1), they go out together instead of one
    network write per token, and the chunks of one choice are merged first (`_merge_ready`), so
    they are decoded, parsed and framed once: an event carries every token that was ready.

    A consumer that stops early (closes the generator, or is cancelled: the client left) stops
    the engine, and each choice not yet finished is noted as an `AbortedCall`, never recorded as
    a finished call with a cut reply.
    """
    # What the engine handed over and nobody has taken yet, in order (unbounded: a pump never
    # waits), and the future the consumer sleeps on while it is empty. A plain list, not an
    # asyncio.Queue: a chunk per token went through the queue's put and get, a tenth of a
    # short streamed call.
    ready: list[tuple[int, TokenChunk | BaseException | None]] = []
    wake: list[asyncio.Future[None]] = []
    streams = [_ChoiceStream(deps, call, i) for i in range(call.request.n)]

    def hand_over(item: tuple[int, TokenChunk | BaseException | None]) -> None:
        ready.append(item)
        if wake and not wake[0].done():
            wake[0].set_result(None)

    async def pump(i: int) -> None:
        try:
            async for chunk in deps.engine.stream(_engine_request(deps, call, i)):
                hand_over((i, chunk))
        except BaseException as e:  # handed to the consumer, which re-raises
            hand_over((i, e))
            return
        hand_over((i, None))

    first: list[StreamEvent] = [StreamDelta(s.index, d) for s in streams if (d := s.start())]
    if first:
        yield first
    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        running = len(streams)
        loop = asyncio.get_running_loop()
        while running:
            if not ready:
                wake.append(loop.create_future())
                try:
                    await wake[0]
                finally:
                    wake.clear()
            items = _merge_ready(ready[:])
            ready.clear()
            batch: list[StreamEvent] = []
            error: BaseException | None = None
            for i, item in items:
                if isinstance(item, BaseException):
                    error = item
                    break
                if item is None:
                    running -= 1
                    delta, fin = streams[i].finish(session)
                    if delta.deltas:
                        batch.append(delta)
                    batch.append(fin)
                    continue
                delta = streams[i].push(item)
                if delta.deltas or delta.logprobs:
                    batch.append(delta)
            if batch:
                yield batch
            if error is not None:
                raise error
    except (GeneratorExit, asyncio.CancelledError):
        for t in tasks:  # stop sampling first: the engine drops the sequences
            t.cancel()
        for s in streams:
            if not s.done:
                record_aborted(deps, session, call, s.index, s.sampled)
        raise
    finally:
        for t in tasks:
            t.cancel()


async def complete_stream(
    deps: GatewayDeps, session: Session | None, call: PreparedCall
) -> AsyncIterator[StreamEvent]:
    """Serve a streamed call: reply deltas as the engine samples, then one finish per choice."""
    async with aclosing(complete_stream_batches(deps, session, call)) as batches:
        async for batch in batches:
            for ev in batch:
                yield ev
