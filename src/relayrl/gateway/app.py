"""The gateway's FastAPI app: three wire formats onto one completion path, plus the RL routes.

`create_app(deps)` keeps all state on `app.state.deps`; routes are module-level functions. Errors
raised anywhere below become the calling protocol's own JSON error body in one place
(`_relay_error`), so a client mistake is never a 500 and never a stack trace.

May import: FastAPI/Starlette, `relayrl.chat`, `relayrl.trajectory`, `relayrl.errors` and the
other `relayrl.gateway` modules (`routes_rl` registers into this app and never imports it back).
Never `client`, `workflow`, `rollout`, `train` or torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relayrl import viewer
from relayrl.asgi import EventStream, StreamState, watch_disconnect
from relayrl.chat import wire_openai_chat
from relayrl.chat.completion import Choice, Completion, CompletionRequest, TokenLogprob
from relayrl.chat.conversation import (
    ContentDelta,
    ParsedReply,
    ReasoningDelta,
    ReplyDelta,
    ToolCallDelta,
)
from relayrl.errors import InvalidRequest, RelayError, SessionClosed
from relayrl.gateway import idempotency, openapi, rollout_callback, routes_rl, routes_rl_v1
from relayrl.gateway.auth import calling_session, redact_path
from relayrl.gateway.bodies import read_json
from relayrl.gateway.core import (
    GatewayDeps,
    PreparedCall,
    StreamFinish,
    complete,
    complete_stream_batches,
    prepare_async,
)
from relayrl.gateway.guard import Guard
from relayrl.gateway.upkeep import Upkeep
from relayrl.gateway.wires import ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES, Wire, interaction_id
from relayrl.trajectory import Session
from relayrl.trajectory.links import REQUEST_LINK_KEY, signal_from_request
from relayrl.trajectory.roles import ROLE_HEADER, resolve_role

log = logging.getLogger("relayrl.gateway")
T = TypeVar("T")


def _deps(request: Request) -> GatewayDeps:
    return request.app.state.deps


def _parse(deps: GatewayDeps, wire: Wire, body: Any) -> CompletionRequest:
    model = wire.format.parse_body(body)
    extra = set(model.extra_fields()) - deps.warned_fields
    if extra:
        deps.warned_fields.update(extra)
        log.info("ignoring unknown %s request fields: %s", wire.name, ", ".join(sorted(extra)))
    return wire.format.to_request(model)


async def serve_completion(request: Request, wire: Wire) -> Any:
    """Parse a call in `wire` format, run it, and answer in the same format.

    The caller's key (path or header) is checked before the body is read or parsed. A session
    call with an `Idempotency-Key` that was answered before gets that answer again (`idempotency`).
    """
    request.state.wire = wire
    deps = _deps(request)
    # who is calling is known from the headers and path: refuse a stranger before reading a body
    session = calling_session(deps, request)
    idem_key = idempotency.read_key(request.headers)
    body = await read_json(request)
    req = _parse(deps, wire, body)
    if request.path_params.get("role") is not None and not deps.config.roles:
        raise InvalidRequest("this is a role-scoped URL, but the gateway records no roles: "
                             "set gateway.roles: true")
    if session is not None and deps.config.roles:
        req = replace(req, role=call_role(deps, request, session, req))
    link = signal_from_request(request.headers, req.metadata.get("metadata"))
    if link is not None:  # compaction / sub-agent signal: recorded with the call, used by locate
        # the parent may be named by the reply id the agent saw (`chatcmpl-...`, `resp_...`)
        link = replace(link, parent_id=interaction_id(link.parent_id))
        req.metadata[REQUEST_LINK_KEY] = link.to_dict()
    callback = rollout_callback.from_body(body) if wire is OPENAI_CHAT else None
    if callback is not None:  # the remote rollout protocol
        rollout_callback.check_request(callback, session, req.stream)
    if session is not None:
        session_open(deps, session)
    if req.n > deps.config.max_n:
        raise InvalidRequest(f"n={req.n} is more than this gateway serves ({deps.config.max_n})")
    slot: idempotency.Slot | None = None
    if idem_key is not None and session is not None:  # an unrecorded call has nothing to replay
        claimed = await deps.idempotency.claim(session, idem_key,
                                               idempotency.fingerprint(wire.name, body))
        if isinstance(claimed, idempotency.Answer):
            return _replay(deps, wire, req, claimed)
        slot = claimed
    try:
        call = await prepare_async(deps, session, req)
        if not req.stream:
            completion = await _unless_client_leaves(request, complete(deps, session, req, call))
            if completion is None:
                return Response(status_code=499)  # nobody is listening; noted as aborted
            payload = wire.format.render_completion(completion, req)
            if callback is not None and session is not None:
                rollout_callback.apply(session, completion, callback, payload)
            if slot is not None:
                deps.idempotency.fulfil(slot, idempotency.Answer(completion, payload))
            return completion_response(wire, req, payload)
        stream = EventStream(_sse(deps, wire, session, call, slot), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        slot = None  # the stream owns it now: it fulfils or releases it as it ends
        return stream
    finally:
        if slot is not None:
            deps.idempotency.release(slot)


def completion_response(wire: Wire, req: CompletionRequest, payload: dict[str, Any]) -> Response:
    """The JSON answer to a non-streamed call, byte for byte what `JSONResponse` sends.

    orjson encodes a short answer in a tenth of the stdlib's time, and writes every string as
    the stdlib does with `ensure_ascii=False`, but not every float (1e-05 is 0.00001 to it).
    A Chat Completions answer without logprobs holds no float (ids, text, token counts), so it
    is encoded by orjson; the rest keep the stdlib's encoding.
    """
    if wire is OPENAI_CHAT and not req.logprobs:
        return Response(orjson.dumps(payload), media_type="application/json")
    return JSONResponse(payload)


def call_role(deps: GatewayDeps, request: Request, session: Session,
              req: CompletionRequest) -> str | None:
    """The role a session's call is recorded under, by the documented precedence."""
    return resolve_role(header=request.headers.get(ROLE_HEADER),
                        path=request.path_params.get("role"), model=req.model,
                        session_metadata=session.metadata, role_models=deps.config.role_models)


def _replay(deps: GatewayDeps, wire: Wire, req: CompletionRequest,
            answer: idempotency.Answer) -> Any:
    """The recorded answer to a retried call: the same body, or the same events as a stream."""
    if answer.payload is not None:
        return JSONResponse(answer.payload)
    c = answer.completion
    enc = wire.format.StreamEncoder.for_request(replace(req, model=deps.model_label), c.id,
                                                c.created)
    frames = enc.start(prompt_tokens=c.prompt_tokens)
    for ch in c.choices:
        for d in reply_deltas(ch.reply):
            frames += enc.delta(ch.index, d, None)
        if ch.logprobs:
            frames += enc.delta(ch.index, None, ch.logprobs)
        frames += enc.finish(ch.index, ch.finish_reason, ch.interaction_id,
                             stop_sequence=ch.stop_sequence)
    frames += enc.end(c.prompt_tokens, c.completion_tokens)

    async def once() -> AsyncIterator[str]:
        yield "".join(frames)

    return StreamingResponse(once(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


def reply_deltas(reply: ParsedReply) -> list[ReplyDelta]:
    """A whole parsed reply as stream deltas: reasoning, text, then each tool call at once."""
    out: list[ReplyDelta] = []
    if reply.reasoning:
        out.append(ReasoningDelta(reply.reasoning))
    if reply.content:
        out.append(ContentDelta(reply.content))
    for i, tc in enumerate(reply.tool_calls):
        out.append(ToolCallDelta(i, tc.arguments, id=tc.id, name=tc.name))
    return out


async def answer_completion(request: Request, wire: Wire) -> Any:
    """`serve_completion`, with any failure answered in the wire's own error shape."""
    # Errors are answered here, not by Starlette's catch-all handler: that one re-raises after
    # answering, and uvicorn then drops the keep-alive connection of every failed call.
    try:
        return await serve_completion(request, wire)
    except Exception as exc:  # every failure becomes the wire's own error body
        request.state.wire = wire
        return await _relay_error(request, exc)


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (and so the generation) if the client disconnects first."""
    # `work` runs in this task, and a watcher cancels the task if the client leaves: one task
    # per call instead of two (`EventStream` watches a stream the same way)
    current = asyncio.current_task()
    assert current is not None  # ASGI apps run in a task
    state = StreamState()
    watcher = asyncio.create_task(watch_disconnect(request.receive, current, state))
    try:
        return await work
    except asyncio.CancelledError:
        if not state.client_left:
            raise  # we were cancelled ourselves, not by the client leaving
        current.uncancel()
        return None
    finally:
        state.done = True
        watcher.cancel()


def session_open(deps: GatewayDeps, session: Session) -> None:
    """Raise 409 unless the session still takes calls; mark it active."""
    if not session.is_open:
        raise SessionClosed(f"session {session.id} is {session.state}; it takes no more calls")


async def _sse(deps: GatewayDeps, wire: Wire, session: Session | None,
               call: PreparedCall, slot: idempotency.Slot | None = None) -> AsyncIterator[str]:
    # every frame names the policy that answers, as the non-streamed reply does
    req = replace(call.request, model=deps.model_label)
    created = int(time.time())
    enc = wire.format.StreamEncoder.for_request(req, call.interaction_ids[0], created)
    prompt_tokens = len(call.prompt_ids)
    completion_tokens = 0
    # kept only for an Idempotency-Key retry: the choices as they finished, logprobs per choice
    choices: list[Choice] = []
    lps: dict[int, list[TokenLogprob]] = {}
    # Every write is a syscall and a wake-up of the client, and costs about as much as framing
    # a batch: the opening frames go out with the first batch, and the last batch (every choice
    # finished) with the closing frames. One write per batch of ready events, not one per token.
    pending = enc.start(prompt_tokens=prompt_tokens)
    unfinished = call.request.n
    try:
        async with aclosing(complete_stream_batches(deps, session, call)) as batches:
            async for batch in batches:
                frames, pending = pending, []
                for ev in batch:
                    if isinstance(ev, StreamFinish):
                        unfinished -= 1
                        completion_tokens += ev.output_tokens
                        frames += enc.finish(ev.index, ev.finish_reason, ev.interaction_id,
                                             stop_sequence=ev.stop_sequence)
                        if slot is not None:
                            got = lps.get(ev.index)
                            choices.append(Choice(ev.index, ev.reply, ev.finish_reason,
                                                  ev.interaction_id,
                                                  tuple(got) if got is not None else None,
                                                  ev.output_tokens, ev.stop_sequence))
                        continue
                    last = len(ev.deltas) - 1
                    for i, d in enumerate(ev.deltas):
                        frames += enc.delta(ev.index, d, ev.logprobs if i == last else None)
                    if not ev.deltas and ev.logprobs:
                        frames += enc.delta(ev.index, None, ev.logprobs)
                    if slot is not None and ev.logprobs:
                        lps.setdefault(ev.index, []).extend(ev.logprobs)
                if unfinished == 0:
                    pending = frames  # nothing follows but the end: one write for both
                elif frames:
                    yield "".join(frames)
        if slot is not None:
            choices.sort(key=lambda ch: ch.index)
            deps.idempotency.fulfil(slot, idempotency.Answer(Completion(
                id=call.interaction_ids[0], model=deps.model_label, created=created,
                choices=tuple(choices), prompt_tokens=prompt_tokens)))
    except RelayError as e:
        yield "".join([*pending, *enc.error(e)])
        return
    except Exception as e:  # a bug must end the stream cleanly, not the connection
        log.exception("unexpected error while streaming", exc_info=e)
        yield "".join([*pending, *enc.error(
            RelayError("internal error; the gateway log has the details"))])
        return
    finally:
        if slot is not None:
            deps.idempotency.release(slot)  # no-op once fulfilled
    yield "".join([*pending, *enc.end(prompt_tokens, completion_tokens)])


async def chat_completions(request: Request) -> Any:
    """OpenAI Chat Completions."""
    return await answer_completion(request, OPENAI_CHAT)


async def responses(request: Request) -> Any:
    """OpenAI Responses."""
    return await answer_completion(request, OPENAI_RESPONSES)


async def messages(request: Request) -> Any:
    """Anthropic Messages."""
    return await answer_completion(request, ANTHROPIC)


async def root() -> dict[str, str]:
    """The service's name: what a client's reachability check (`HEAD /`) is answered."""
    return {"object": "relayrl.gateway", "status": "ok"}


async def count_tokens(request: Request) -> JSONResponse:
    """Anthropic `count_tokens`: the prompt's length as this policy's template renders it."""
    request.state.wire = ANTHROPIC
    deps = _deps(request)
    calling_session(deps, request)  # the same keys as /v1/messages, checked before the body
    body = await read_json(request)
    if isinstance(body, dict):
        body = {"max_tokens": 1, **body}  # its bodies carry no max_tokens; nothing is generated
    req = _parse(deps, ANTHROPIC, body)
    return JSONResponse({"input_tokens": len(deps.renders.render(deps.renderer,
                                                                 req.conversation))})


async def list_models(request: Request) -> dict[str, Any]:
    """OpenAI-style model list: the policy being served."""
    deps = _deps(request)
    return {"object": "list", "data": [{"id": deps.model_label, "object": "model",
                                        "created": int(deps.started), "owned_by": "relayrl"}]}


def _wire_for(request: Request) -> Wire:
    wire = getattr(request.state, "wire", None)
    if wire is not None:
        return wire
    return ANTHROPIC if request.url.path.rstrip("/").endswith("/messages") else OPENAI_CHAT


async def _relay_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, RelayError):
        log.exception("unexpected error on %s", redact_path(request.url.path), exc_info=exc)
        exc = RelayError("internal error; the gateway log has the details")
    return JSONResponse(_wire_for(request).format.error_body(exc), status_code=exc.status_code)


_WIRE_SUFFIXES = ("/chat/completions", "/responses", "/messages")
"""Paths whose routes answer their own errors (`answer_completion`)."""


class _AnswerUnexpectedErrors:
    """Answers an unexpected exception in the route's error shape without re-raising it.

    Starlette hands a handler for `Exception` to its outermost middleware, which answers and then
    re-raises, so uvicorn drops the keep-alive connection of every such call. This sits inside
    that middleware and absorbs the exception once the answer is sent. The completion routes
    answer their own errors, so their messages skip the extra `send` wrapper.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].endswith(_WIRE_SUFFIXES):
            await self.app(scope, receive, send)
            return
        started = False

        async def sender(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, sender)
        except Exception as exc:
            if started:
                raise  # half an answer is out: nothing better than closing the connection
            response = await _relay_error(Request(scope, receive), exc)
            await response(scope, receive, send)


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    from relayrl.errors import NotFound

    return await _relay_error(
        request, NotFound(f"no route {request.method} {redact_path(request.url.path)}"))


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    deps: GatewayDeps = app.state.deps
    period = min(30.0, max(0.5, deps.config.session_ttl_s / 4))
    upkeep = Upkeep(deps.store, deps.log, compact_after_closed=deps.config.compact_after_closed,
                    compact_every_s=deps.config.compact_every_s,
                    caches=(deps.renders.clear, deps.renderer.forget_cached_pieces,
                            wire_openai_chat.forget_interned))
    app.state.upkeep = upkeep

    async def expire_idle() -> None:
        while True:  # runs for the app's lifetime; cancelled at shutdown
            await asyncio.sleep(period)
            try:
                await upkeep.tick()
            except Exception:  # a failed compaction must not stop expiry for good
                log.exception("gateway upkeep failed; trying again in %.1f s", period)

    task = asyncio.create_task(expire_idle())
    try:
        yield
    finally:
        task.cancel()
        if deps.owns_engine:  # its model and serving thread go with the gateway
            await deps.engine.aclose()


Handler = Callable[[Request], Awaitable[Any]]


class _GatewayApp(FastAPI):
    """FastAPI, with the calls an agent makes on every turn served straight from `__call__`.

    Starlette passes each request through seven middlewares and a linear route match before a
    handler runs; for a short call that is about a tenth of the gateway's time. The completion
    and session routes in `fast` need none of it: the completion routes answer their own errors
    and the rest are wrapped by `_answer`. The Guard's checks still run first; everything else
    (other methods, other paths, `/s/{key}/...`) takes the usual way.
    """

    fast: dict[str, Handler]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.fast.get(scope["path"]) if scope["type"] == "http" and \
            scope["method"] == "POST" else None
        if handler is None:
            await super().__call__(scope, receive, send)
            return
        if Guard.check(scope) is not None:  # the Guard answers it, as on the usual way
            await Guard(self.router)(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive, send)
        response = await handler(request)
        await response(scope, receive, send)


def _answer(route: Handler) -> Handler:
    """A JSON route for the fast path: its dict as JSON (or its own response), its errors in
    OpenAI's error shape."""

    async def answer(request: Request) -> Response:
        try:
            result = await route(request)
        except Exception as exc:  # what the app's exception handlers would have answered
            return await _relay_error(request, exc)
        return result if isinstance(result, Response) else JSONResponse(result)

    return answer


_FAST_RL = (routes_rl.start_session, routes_rl.end_session, routes_rl.set_reward)
"""Session routes an agent calls once per episode, served on the fast path (every alias)."""


def create_app(deps: GatewayDeps) -> FastAPI:
    """Build the gateway app around `deps`."""
    # /openapi.json lists every route (gateway.openapi adds what FastAPI cannot see); no
    # interactive docs pages, which would load scripts from a CDN
    app = _GatewayApp(title="relayrl gateway", docs_url=None, redoc_url=None,
                      openapi_url="/openapi.json", lifespan=_lifespan)
    app.fast = {"/v1/chat/completions": chat_completions, "/chat/completions": chat_completions,
                "/v1/responses": responses, "/responses": responses, "/v1/messages": messages,
                **{path: _answer(r.handler) for r in routes_rl.ROUTES if r.handler in _FAST_RL
                   for path in r.paths if "{" not in path}}
    app.state.deps = deps
    # Sessions are reached by key only: header, or the key-addressed `/s/{key}/v1` base URL
    # (routes_rl_v1). There is no id-addressed form: an id names a session, it opens nothing.
    for path in ("/v1/chat/completions", "/chat/completions"):
        app.add_route(path, chat_completions, methods=["POST"])
    for path in ("/v1/responses", "/responses"):
        app.add_route(path, responses, methods=["POST"])
    app.add_route("/v1/messages", messages, methods=["POST"])
    app.add_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    # Clients check that a base URL answers before their first call (Claude Code sends
    # `HEAD /` to ANTHROPIC_BASE_URL, which is a session's `/s/{key}`): a plain 200, no data
    for path in ("/", "/s/{session_key}", "/s/{session_key}/"):
        app.add_api_route(path, root, methods=["GET", "HEAD"])
    routes_rl.register(app)
    routes_rl_v1.register(app)
    app.mount("/view", viewer.for_gateway(deps))  # relayrl view: watch sessions live
    openapi.install(app)
    app.add_middleware(Guard)
    app.add_exception_handler(RelayError, _relay_error)
    app.add_exception_handler(Exception, _relay_error)
    app.add_middleware(_AnswerUnexpectedErrors)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _not_found)
    return app
