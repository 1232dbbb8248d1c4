"""The router's ASGI app: one public URL in front of several gateways, session-affine.

`start_session` goes to the least-loaded healthy backend and binds the new session's key (by
its SHA-256) and id to that backend; every later call carrying the key (header or `/s/{key}/`
path) or naming the id (`/sessions/{id}/`, or `session_id` in an admin body) goes to it.
Completions are relayed byte for byte (streams chunk by chunk, as they arrive). Admin routes
that concern every backend fan out (`/rl/sessions`, `/rl/v1/set_version`, `/grant_capacity`,
`/rl/v1/status`: counts summed, sections it cannot add up taken from the first backend). Keys
are passed through to the backends, which authenticate; the router only routes, and never
logs a key. With tenants, a key must be a tenant's key or a session key bound
through it, and a tenant's calls only ever reach that tenant's own backends.

The outbound pool is aiohttp's: about a third of the CPU per relayed call of httpx's transport
(httpcore on anyio), measured in benchmarks/bench_router_cpu.py.

May import: starlette, aiohttp, relayrl.errors, relayrl.chat (error bodies), relayrl.router.
Never the gateway's internals (it talks to gateways over HTTP only), nor torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from yarl import URL

from relayrl.asgi import EventStream
from relayrl.chat import wire_anthropic, wire_openai_chat
from relayrl.errors import (
    AuthenticationFailed,
    EngineError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RelayError,
)
from relayrl.router.config import RouterConfig, Tenant

log = logging.getLogger("relayrl.router")

_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
                  b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length"})
_OWN = frozenset({b"date", b"server"})  # uvicorn sets its own
_DROP = _HOP | _OWN
_START = frozenset({"/rl/start_session", "/rl/v1/start_session"})
_BY_ID_BODY = frozenset({"/export_trajectories", "/rl/ack_export", "/rl/abort_session"})
_FAN_SUM = {"/grant_capacity": "capacity"}


@dataclass(eq=False)
class Backend:
    """One gateway behind the router, as the router sees it."""

    url: str
    tenant: Tenant | None = None
    healthy: bool = False
    """Up at its last health check or relayed call; none go to a backend before its first good
    check (a router started before its gateways waits for them)."""
    failures: int = 0
    polled_open: int = 0
    """Open sessions at the last health check."""
    started: int = 0
    """Sessions this router started there since that check."""

    @property
    def load(self) -> int:
        """Open sessions, as last seen plus those started since."""
        return self.polled_open + self.started

    def public(self) -> dict[str, Any]:
        """What `/health` shows of this backend (single-tenant mode only)."""
        return {"url": self.url, "healthy": self.healthy, "open_sessions": self.load}


@dataclass
class Caller:
    """Who sent a request, as far as routing goes."""

    scope: list[Backend]
    """Backends this caller may reach."""
    tenant: Tenant | None = None
    """The tenant whose own key the caller used (None: a session key, or single-tenant mode)."""
    owner: Backend | None = None
    """The backend holding the caller's session, when its key is bound."""
    keyed: bool = False
    """Whether the request carried a key at all."""


class _Bounded(OrderedDict[Any, Backend]):
    """Key -> backend, forgetting the oldest entries beyond `limit`."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def bind(self, key: Any, backend: Backend) -> None:
        self[key] = backend
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _request_key(request: Request, path_key: str | None) -> str | None:
    if path_key:
        return path_key
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


def error_response(path: str, exc: RelayError, headers: dict[str, str] | None = None) -> JSONResponse:
    """`exc` in the error shape of the route's own wire format (Anthropic or OpenAI)."""
    anthropic = path.rstrip("/").endswith("/messages")
    body = (wire_anthropic if anthropic else wire_openai_chat).error_body(exc)
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def stream_error_frame(path: str, exc: RelayError) -> bytes:
    """The SSE frame that ends a broken stream, as the gateway itself ends one that fails
    (chat: a `data:` error body; Responses and Anthropic Messages: an `error` event)."""
    if path.rstrip("/").endswith("/messages"):
        body, event = wire_anthropic.error_body(exc), "error"
    elif path.rstrip("/").endswith("/responses"):
        e = wire_openai_chat.error_body(exc)["error"]
        body = {"type": "error", "code": e["code"] or e["type"], "message": e["message"],
                "param": e["param"]}
        event = "error"
    else:
        body, event = wire_openai_chat.error_body(exc), None
    data = json.dumps(body, separators=(",", ":"))
    return (f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n").encode()


def _unavailable(message: str) -> EngineError:
    return EngineError(message)  # 503


@dataclass
class _Upstream:
    """A buffered backend answer."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def response(self) -> Response:
        out = Response(self.body, status_code=self.status)
        out.raw_headers = [*self.headers, (b"content-length", str(len(self.body)).encode())]
        return out


def open_session(config: RouterConfig) -> aiohttp.ClientSession:
    """The relay's connection pool (call from within the event loop that will use it)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30,
                                     enable_cleanup_closed=False)
    timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s,
                                    sock_read=config.read_timeout_s)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False, trust_env=False, raise_for_status=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))


@dataclass
class Router:
    """Backends, bindings and the shared connection pool; `app()` serves them."""

    config: RouterConfig
    backends: list[Backend] = field(default_factory=list)
    keys: _Bounded = field(init=False)
    sessions: _Bounded = field(init=False)
    session: aiohttp.ClientSession | None = None
    """The shared connection pool calls and health checks go over: no cookie jar (a relay must
    not carry one backend's cookies to another), no redirects, no decompression (bytes are
    relayed as the gateway sent them), no default headers added."""
    _tenants: dict[str, Tenant] = field(default_factory=dict)
    _turn: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.config.validate()
        self.keys = _Bounded(self.config.max_bindings)
        self.sessions = _Bounded(self.config.max_bindings)
        if self.config.tenants:
            self._tenants = {t.key_sha256: t for t in self.config.tenants}
            self.backends = [Backend(u, t) for t in self.config.tenants for u in t.backends]
        else:
            self.backends = [Backend(u.rstrip("/")) for u in self.config.backends]

    # ------------------------------------------------------------------ who and where

    def caller(self, request: Request, path_key: str | None) -> Caller:
        """Resolve the request's key to a scope; raise 401 for an unknown key under tenants."""
        key = _request_key(request, path_key)
        if key:
            owner = self.keys.get(_digest(key))
            if owner is not None:
                return Caller([owner], None, owner, keyed=True)
        if not self._tenants:
            return Caller(self.backends, keyed=bool(key))
        tenant = self._tenants.get(hashlib.sha256(key.encode()).hexdigest()) if key else None
        if tenant is None:
            raise AuthenticationFailed("invalid API key")
        return Caller([b for b in self.backends if b.tenant is tenant], tenant, keyed=True)

    def ranked(self, scope: Iterable[Backend]) -> list[Backend]:
        """Healthy backends of `scope`, least loaded first (ties taken in turn)."""
        healthy = [b for b in scope if b.healthy]
        if len(healthy) > 1:
            turn = next(self._turn)
            n = len(healthy)
            healthy = [healthy[(i + turn) % n] for i in range(n)]
            healthy.sort(key=lambda b: b.load)
        return healthy

    def mark_down(self, backend: Backend, why: str) -> None:
        """Take `backend` out of rotation until a health check sees it again."""
        if backend.healthy:
            log.warning("backend %s is down: %s", backend.url, why)
        backend.healthy = False
        backend.failures = max(backend.failures, self.config.down_after)

    # ------------------------------------------------------------------ forwarding

    def _headers(self, request: Request, caller: Caller) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP]
        if caller.tenant is not None and caller.tenant.backend_key:
            headers = [(k, v) for k, v in headers if k.lower() not in (b"authorization", b"x-api-key")]
            headers.append((b"authorization", b"Bearer " + caller.tenant.backend_key.encode()))
        return headers

    def _url(self, backend: Backend, request: Request) -> URL:
        # The raw path and query, as the client sent them (no decoding and re-encoding).
        scope = request.scope
        query = scope.get("query_string", b"")
        raw = scope.get("raw_path") or scope["path"].encode()
        target = (raw + b"?" + query if query else raw).decode("latin-1")
        return URL(backend.url + target, encoded=True)

    async def send(self, backend: Backend, request: Request, caller: Caller,
                   body: bytes) -> aiohttp.ClientResponse:
        """Send the request to `backend` and return its answer unread (raises EngineError)."""
        assert self.session is not None
        headers = [(k.decode("latin-1"), v.decode("latin-1"))
                   for k, v in self._headers(request, caller)]
        try:
            return await self.session.request(
                request.method, self._url(backend, request), headers=headers,
                data=body or None, allow_redirects=False)
        except aiohttp.ClientConnectorError as e:
            self.mark_down(backend, type(e).__name__)
            raise _unavailable("the gateway for this request is unreachable") from None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _unavailable(f"the gateway for this request failed ({type(e).__name__})") from None

    @staticmethod
    def _answer_headers(resp: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in resp.raw_headers if k.lower() not in _DROP]

    @staticmethod
    async def _read(resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            resp.close()
            raise _unavailable(f"the gateway's answer broke off ({type(e).__name__})") from None
        finally:
            resp.release()

    async def buffered(self, backend: Backend, request: Request, caller: Caller,
                       body: bytes) -> _Upstream:
        """The backend's whole answer, raw bytes (no decoding)."""
        resp = await self.send(backend, request, caller, body)
        content = await self._read(resp)
        return _Upstream(resp.status, self._answer_headers(resp), content)

    async def relay(self, backend: Backend, request: Request, caller: Caller,
                    body: bytes) -> Response:
        """Forward to `backend` and answer with its bytes: SSE streamed through, others whole."""
        if not backend.healthy:
            raise _unavailable("the gateway holding this session is down; start a new session")
        resp = await self.send(backend, request, caller, body)
        headers = self._answer_headers(resp)
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            content = await self._read(resp)
            return _Upstream(resp.status, headers, content).response()

        path = request.scope["path"]

        async def chunks() -> AsyncIterator[bytes]:
            ended = True  # at a frame boundary
            complete = False
            try:
                async for chunk in resp.content.iter_any():
                    if chunk:
                        ended = chunk.endswith(b"\n\n")
                    yield chunk
                complete = True
            except (aiohttp.ClientError, TimeoutError) as e:
                log.warning("stream from %s broke off (%s)", backend.url, type(e).__name__)
                yield (b"" if ended else b"\n\n") + stream_error_frame(
                    path, _unavailable("the gateway holding this session stopped mid-stream"))
            finally:
                if complete:
                    resp.release()  # the connection goes back to the pool
                else:
                    resp.close()  # mid-answer: the connection cannot be reused

        async def close() -> None:  # async: a sync background task would hop to a thread
            resp.close()

        # EventStream: a client leaving cancels the relay with one plain task (Starlette's
        # StreamingResponse runs an anyio task group per stream for that)
        out = EventStream(chunks(), status_code=resp.status, background=BackgroundTask(close))
        out.raw_headers = headers
        return out

    async def probe(self, scope: list[Backend], request: Request, caller: Caller, body: bytes,
                    misses: frozenset[int]) -> Response:
        """Try each healthy backend of `scope` until one answers other than `misses` (a session
        the router has no binding for: started elsewhere, or before a router restart)."""
        ranked = self.ranked(scope)
        if not ranked:
            raise _unavailable("no gateway is available")
        for backend in ranked[:-1]:
            try:
                answer = await self.buffered(backend, request, caller, body)
            except EngineError:
                continue
            if answer.status not in misses:
                return answer.response()
        return await self.relay(ranked[-1], request, caller, body)

    # ------------------------------------------------------------------ routes

    async def start_session(self, request: Request, caller: Caller, body: bytes) -> Response:
        """Open a session on the least-loaded healthy backend and bind it there."""
        if caller.owner is not None:
            raise AuthenticationFailed("this route needs the admin key")
        chosen = None
        if body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            chosen = parsed.get("api_key") if isinstance(parsed, dict) else None
            if isinstance(chosen, str) and _digest(chosen) in self.keys:
                raise InvalidRequest("api_key is already in use; choose another")
        ranked = self.ranked(caller.scope)
        if not ranked:
            raise _unavailable("no gateway is available to start a session")
        refused: _Upstream | None = None
        for backend in ranked:
            try:
                answer = await self.buffered(backend, request, caller, body)
            except EngineError:
                continue
            if answer.status == 429:
                refused = answer
                continue
            data = answer.json()
            if answer.status != 200 or not isinstance(data, dict) or "api_key" not in data:
                return answer.response()
            self.keys.bind(_digest(data["api_key"]), backend)
            self.sessions.bind(data["session_id"], backend)
            backend.started += 1
            if "base_url" in data:
                data["base_url"] = f"{str(request.base_url).rstrip('/')}/s/{data['api_key']}/v1"
            return JSONResponse(data)
        if refused is not None:
            return refused.response()
        raise _unavailable("no gateway is available to start a session")

    async def fan_out(self, request: Request, caller: Caller,
                      body: bytes) -> tuple[list[tuple[Backend, Any]], Response | None, int]:
        """Send to every healthy backend of the caller's scope: answers, the first failure, and
        how many backends were unreachable."""
        ranked = [b for b in caller.scope if b.healthy]
        results = await asyncio.gather(*(self.buffered(b, request, caller, body) for b in ranked),
                                       return_exceptions=True)
        answers: list[tuple[Backend, Any]] = []
        unreachable = len(caller.scope) - len(ranked)
        for backend, result in zip(ranked, results, strict=True):
            if isinstance(result, EngineError):
                unreachable += 1
                continue
            if isinstance(result, BaseException):
                raise result
            if result.status != 200:
                return answers, result.response(), unreachable
            answers.append((backend, result.json()))
        if not answers:
            raise _unavailable("no gateway is available")
        return answers, None, unreachable

    async def list_sessions(self, request: Request, caller: Caller, body: bytes) -> Response:
        """`/rl/sessions` of every backend, merged (and each session's owner remembered)."""
        answers, failed, unreachable = await self.fan_out(request, caller, body)
        if failed is not None:
            return failed
        merged = []
        for backend, data in answers:
            for s in data.get("sessions", []):
                if isinstance(s, dict) and isinstance(s.get("session_id"), str):
                    self.sessions.bind(s["session_id"], backend)
                merged.append(s)
        limit = request.query_params.get("limit", "1000")
        result: dict[str, Any] = {"sessions": merged[: int(limit)] if limit.isdigit() else merged}
        if unreachable:
            result["unreachable_backends"] = unreachable
        return JSONResponse(result)

    async def set_version(self, request: Request, caller: Caller, body: bytes) -> Response:
        """Announce a weight version to every backend; the lowest version they report back."""
        answers, failed, unreachable = await self.fan_out(request, caller, body)
        if failed is not None:
            return failed
        result = {"version": min(d["version"] for _, d in answers),
                  "capacity": sum(d.get("capacity", 0) for _, d in answers),
                  "backends": len(answers)}
        if unreachable:
            result["unreachable_backends"] = unreachable
        return JSONResponse(result)

    async def grant_capacity(self, request: Request, caller: Caller, body: bytes) -> Response:
        """Capacity summed over the backends."""
        answers, failed, _ = await self.fan_out(request, caller, body)
        if failed is not None:
            return failed
        return JSONResponse({"capacity": sum(d.get("capacity", 0) for _, d in answers)})

    async def status(self, request: Request, caller: Caller, body: bytes) -> Response:
        """`/rl/v1/status` over the caller's backends: counts summed, the oldest policy version."""
        answers, failed, unreachable = await self.fan_out(request, caller, body)
        if failed is not None:
            return failed
        datas = [d for _, d in answers]
        sessions: dict[str, int] = {}
        for d in datas:
            for k, v in d.get("sessions", {}).items():
                sessions[k] = sessions.get(k, 0) + int(v)
        count = sum(d["recent_reward"]["count"] for d in datas)
        total = sum(d["recent_reward"]["mean"] * d["recent_reward"]["count"]
                    for d in datas if d["recent_reward"]["count"])
        first = datas[0]
        result = {
            "status": "ok" if not unreachable else "degraded",
            "relayrl_version": first.get("relayrl_version"), "model": first.get("model"),
            "policy_version": min(d.get("policy_version", 0) for d in datas),
            "uptime_s": min(d.get("uptime_s", 0.0) for d in datas),
            "sessions": sessions,
            "recent_reward": {"count": count, "mean": total / count if count else None},
            "backends": {"healthy": len(datas), "total": len(datas) + unreachable},
        }
        # Sections the router cannot add up (a service's `trainer`, which every replica of one
        # service reports alike) pass through from the first backend that answered.
        return JSONResponse({**{k: v for k, v in first.items() if k not in result}, **result})

    def health(self) -> Response:
        """The router's own liveness; backend addresses only without tenants."""
        healthy = sum(b.healthy for b in self.backends)
        body: dict[str, Any] = {"status": "ok" if healthy else "unavailable",
                                "backends_healthy": healthy, "backends_total": len(self.backends)}
        if not self._tenants:
            body["backends"] = [b.public() for b in self.backends]
            body["open"] = sum(b.load for b in self.backends)
        return JSONResponse(body, status_code=200 if healthy else 503)

    def _owner(self, caller: Caller, session_id: str) -> Backend | None:
        """The backend holding `session_id`, if known and within the caller's reach."""
        owner = self.sessions.get(session_id)
        return owner if owner is not None and owner in caller.scope else None

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused (413) past `max_body_bytes` without reading it all."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes")
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def dispatch(self, request: Request) -> Response:
        """Route one request (see the module docstring)."""
        path = request.scope["path"]
        if path == "/health" and request.method == "GET":
            return self.health()
        path_key = None
        if path.startswith("/s/"):
            path_key = path.split("/", 3)[2]
        caller = self.caller(request, path_key)
        body = await self.read_body(request)
        if path in _START:
            return await self.start_session(request, caller, body)
        if caller.owner is not None and not path.startswith("/sessions/"):
            return await self.relay(caller.owner, request, caller, body)
        if path == "/rl/v1/status":
            return await self.status(request, caller, body)
        if path == "/rl/sessions":
            return await self.list_sessions(request, caller, body)
        if path == "/rl/v1/set_version":
            return await self.set_version(request, caller, body)
        if path in _FAN_SUM:
            return await self.grant_capacity(request, caller, body)
        session_id = None
        if path.startswith("/sessions/"):
            session_id = path.split("/", 3)[2]
        elif path in _BY_ID_BODY:
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
                session_id = parsed["session_id"]
        if session_id is not None:
            owner = self._owner(caller, session_id)
            if owner is not None:
                return await self.relay(owner, request, caller, body)
            if caller.owner is not None:  # a session key naming another session
                raise NotFound(f"unknown session {session_id!r}")
            return await self.probe(caller.scope, request, caller, body, frozenset({404}))
        if caller.keyed and caller.tenant is None:
            # a key the router has not bound: a session started elsewhere, or the admin key
            return await self.probe(caller.scope, request, caller, body, frozenset({401}))
        ranked = self.ranked(caller.scope)
        if not ranked:
            raise _unavailable("no gateway is available")
        return await self.relay(ranked[0], request, caller, body)

    async def endpoint(self, request: Request) -> Response:
        """The single ASGI endpoint: dispatch, with errors in the route's own format."""
        try:
            return await self.dispatch(request)
        except RelayError as e:
            return error_response(request.scope["path"], e)

    # ------------------------------------------------------------------ health checks

    async def check(self, backend: Backend) -> None:
        """One health check of `backend`."""
        assert self.session is not None
        try:
            async with self.session.get(
                    backend.url + "/health",
                    timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as r:
                ok = r.status == 200
                data = json.loads(await r.read()) if ok else {}
            ok = ok and isinstance(data, dict)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            ok, data = False, {}
        if ok:
            if not backend.healthy:
                log.warning("backend %s is up", backend.url)
            backend.healthy, backend.failures = True, 0
            backend.polled_open, backend.started = int(data.get("open", 0)), 0
            return
        backend.failures += 1
        if backend.failures >= self.config.down_after:
            self.mark_down(backend, "health check failed")

    async def check_all(self) -> None:
        """Check every backend once, concurrently."""
        await asyncio.gather(*(self.check(b) for b in self.backends))

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Open the connection pool and run health checks for the app's lifetime."""
        self.session = open_session(self.config)
        await self.check_all()

        async def loop() -> None:
            while True:  # for the app's lifetime; cancelled at shutdown
                await asyncio.sleep(self.config.health_interval_s)
                await self.check_all()

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            await self.session.close()

    def app(self) -> Starlette:
        """The ASGI app: every method on every path goes to `endpoint`."""
        app = _RouterApp(self, lifespan=self.lifespan)
        app.state.router = self
        return app


class _RouterApp(Starlette):
    """Starlette for the lifespan and `app.state`; HTTP requests go straight to the router's one
    endpoint, skipping the middleware stack and route matching a single catch-all route does
    not need (profiled: about a fifth of the router's own per-call Python time)."""

    def __init__(self, router: Router, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._relay = router

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive, send)
        try:
            response = await self._relay.endpoint(request)
        except Exception:  # what Starlette's error middleware would do, in the route's format
            log.exception("router error on %s %s", scope["method"], scope["path"])
            response = error_response(scope["path"], RelayError("internal router error"))
        await response(scope, receive, send)


def create_app(config: RouterConfig) -> Starlette:
    """A router app for `config` (its `Router` is on `app.state.router`)."""
    return Router(config).app()
