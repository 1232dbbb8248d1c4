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
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from relayrl import viewer
from relayrl.chat.completion import CompletionRequest
from relayrl.errors import InvalidRequest, RelayError, SessionClosed
from relayrl.gateway import rollout_callback, routes_rl, routes_rl_v1
from relayrl.gateway.auth import calling_session
from relayrl.gateway.bodies import read_json
from relayrl.gateway.core import (
    GatewayDeps,
    PreparedCall,
    StreamFinish,
    complete,
    complete_stream_batches,
    prepare,
)
from relayrl.gateway.wires import ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES, Wire
from relayrl.trajectory import Session

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


async def serve_completion(request: Request, wire: Wire, session_id: str | None) -> Any:
    """Parse a call in `wire` format, run it, and answer in the same format."""
    request.state.wire = wire
    deps = _deps(request)
    body = await read_json(request)
    session = calling_session(deps, request, session_id)
    req = _parse(deps, wire, body)
    callback = rollout_callback.from_body(body) if wire is OPENAI_CHAT else None
    if callback is not None:  # the remote rollout protocol (seed 002)
        rollout_callback.check_request(callback, session, req.stream)
    if session is not None:
        session_open(deps, session)
    if req.n > deps.config.max_n:
        raise InvalidRequest(f"n={req.n} is more than this gateway serves ({deps.config.max_n})")
    if not req.stream:
        completion = await _unless_client_leaves(request, complete(deps, session, req))
        if completion is None:
            return Response(status_code=499)  # nobody is listening; nothing was recorded
        payload = wire.format.render_completion(completion, req)
        if callback is not None and session is not None:
            rollout_callback.apply(session, completion, callback, payload)
        return JSONResponse(payload)
    call = prepare(deps, session, req)
    return EventStream(_sse(deps, wire, session, call), media_type="text/event-stream",
                       headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (and so the generation) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not task.done():  # ends with the work: receive() answers http.disconnect then
            message = await request.receive()
            if message["type"] == "http.disconnect":
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if not watcher.done():
            raise  # we were cancelled ourselves, not by the client leaving
        return None
    finally:
        watcher.cancel()


class EventStream(StreamingResponse):
    """A `StreamingResponse` that notices a client leaving with one plain task.

    uvicorn speaks ASGI 2.3, where sending to a gone client does not fail, so Starlette runs
    every stream in an anyio task group beside a task listening for the disconnect; that costs
    about a tenth of a short streamed call. Here a bare asyncio task listens instead and, if the
    client leaves, cancels the streaming task (which closes the generator, so the engine stops and
    nothing is recorded, as before) and the cancellation is absorbed.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None  # ASGI apps run in a task
        state = _StreamState()
        watcher = asyncio.create_task(_watch_disconnect(receive, streaming, state))
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state.client_left:
                raise
            streaming.uncancel()
        finally:
            state.done = True
            watcher.cancel()
        if self.background is not None:
            await self.background()


@dataclass
class _StreamState:
    done: bool = False
    """The response went out whole (a disconnect seen after that changes nothing)."""
    client_left: bool = False
    """The watcher saw the client leave and cancelled the stream."""


async def _watch_disconnect(receive: Receive, streaming: asyncio.Task[Any],
                            state: _StreamState) -> None:
    # The body was read before streaming began, so what is left is the disconnect; the bound
    # only guards against a server that keeps sending other messages.
    for _ in range(1 << 16):
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    else:
        return
    if not state.done:
        state.client_left = True
        streaming.cancel()


def session_open(deps: GatewayDeps, session: Session) -> None:
    """Raise 409 unless the session still takes calls; mark it active."""
    if not session.is_open:
        raise SessionClosed(f"session {session.id} is {session.state}; it takes no more calls")


async def _sse(deps: GatewayDeps, wire: Wire, session: Session | None,
               call: PreparedCall) -> AsyncIterator[str]:
    req = call.request
    enc = wire.format.StreamEncoder.for_request(req, call.interaction_ids[0], int(time.time()))
    prompt_tokens = len(call.prompt_ids)
    completion_tokens = 0
    yield "".join(enc.start(prompt_tokens=prompt_tokens))
    try:
        # one write per batch of ready events, not one per token
        async with aclosing(complete_stream_batches(deps, session, call)) as batches:
            async for batch in batches:
                frames: list[str] = []
                for ev in batch:
                    if isinstance(ev, StreamFinish):
                        completion_tokens += ev.output_tokens
                        frames += enc.finish(ev.index, ev.finish_reason, ev.interaction_id,
                                             stop_sequence=ev.stop_sequence)
                        continue
                    last = len(ev.deltas) - 1
                    for i, d in enumerate(ev.deltas):
                        frames += enc.delta(ev.index, d, ev.logprobs if i == last else None)
                    if not ev.deltas and ev.logprobs:
                        frames += enc.delta(ev.index, None, ev.logprobs)
                if frames:
                    yield "".join(frames)
    except RelayError as e:
        yield "".join(enc.error(e))
        return
    yield "".join(enc.end(prompt_tokens, completion_tokens))


async def chat_completions(request: Request) -> Any:
    """OpenAI Chat Completions."""
    return await serve_completion(request, OPENAI_CHAT, _session_id(request))


async def responses(request: Request) -> Any:
    """OpenAI Responses."""
    return await serve_completion(request, OPENAI_RESPONSES, _session_id(request))


async def messages(request: Request) -> Any:
    """Anthropic Messages."""
    return await serve_completion(request, ANTHROPIC, _session_id(request))


def _session_id(request: Request) -> str | None:
    # The completion routes are plain Starlette endpoints: FastAPI's per-request dependency
    # solving cost more than the rest of a short call. The id comes from the path, else (as
    # FastAPI gave it to the unprefixed routes) from the query string.
    params = request.path_params
    return params["session_id"] if "session_id" in params else request.query_params.get("session_id")


async def list_models(request: Request, session_id: str | None = None) -> dict[str, Any]:
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
        log.exception("unexpected error on %s", request.url.path, exc_info=exc)
        exc = RelayError("internal error; the gateway log has the details")
    return JSONResponse(_wire_for(request).format.error_body(exc), status_code=exc.status_code)


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    from relayrl.errors import NotFound

    return await _relay_error(request, NotFound(f"no route {request.method} {request.url.path}"))


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    deps: GatewayDeps = app.state.deps
    period = min(30.0, max(0.5, deps.config.session_ttl_s / 4))

    async def expire_idle() -> None:
        while True:  # runs for the app's lifetime; cancelled at shutdown
            await asyncio.sleep(period)
            for s in deps.store.expire():
                log.info("session %s idle past its TTL: aborted", s.id)

    task = asyncio.create_task(expire_idle())
    try:
        yield
    finally:
        task.cancel()


def create_app(deps: GatewayDeps) -> FastAPI:
    """Build the gateway app around `deps`."""
    app = FastAPI(title="relayrl gateway", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_lifespan)
    app.state.deps = deps
    for prefix in ("", "/sessions/{session_id}"):
        for path in ("/v1/chat/completions", "/chat/completions"):
            app.add_route(prefix + path, chat_completions, methods=["POST"])
        for path in ("/v1/responses", "/responses"):
            app.add_route(prefix + path, responses, methods=["POST"])
        app.add_route(prefix + "/v1/messages", messages, methods=["POST"])
        app.add_api_route(prefix + "/v1/models", list_models, methods=["GET"])
    routes_rl.register(app)
    routes_rl_v1.register(app)
    app.mount("/view", viewer.for_gateway(deps))  # relayrl view: watch sessions live
    app.add_exception_handler(RelayError, _relay_error)
    app.add_exception_handler(Exception, _relay_error)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _not_found)
    return app
