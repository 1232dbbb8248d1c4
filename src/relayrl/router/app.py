"""The router's ASGI app: one public URL in front of several gateways, session-affine.

`start_session` goes to the least-loaded healthy backend and binds the new session's key (by
its SHA-256) and id to that backend; every later call carrying the key (header or `/s/{key}/`
path) or naming the id (`/sessions/{id}/`, or `session_id` in an admin body) goes to it. The
session URLs a gateway hands out (`start_session`'s and `child_session`'s `base_url`) are
rewritten to the router's own address, so agents never reach around it.
Completions are relayed byte for byte (streams chunk by chunk, as they arrive). Admin routes
that concern every backend fan out (`/rl/sessions`, `/rl/v1/set_version`, `/grant_capacity`,
`/rl/v1/status`: counts summed, sections it cannot add up taken from the first backend). Keys
are passed through to the backends, which authenticate; the router only routes, and never
logs a key. With tenants, a key must be a tenant's key or a session key bound
through it, and a tenant's calls only ever reach that tenant's own backends.

A relayed call takes the short way through: raw ASGI in and out (no Starlette request or
response objects), and aiohttp's keep-alive client out to the gateway: the request target and
body go out as the client sent them, and the answer's status, raw headers and body bytes come
back without decoding (no cookies kept, no headers added but `host` and `content-length`).
aiohttp rather than httpx: on the router's benchmark it adds about half the time and CPU per
call that httpx's core does (`benchmarks/RESULTS.md`, "Router overhead"). Starlette serves the
lifespan and the answers the router writes itself (errors, fan-outs).

May import: starlette, aiohttp, yarl, relayrl.errors, relayrl.asgi (stream disconnects), relayrl.chat
(error bodies), relayrl.router.
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
from urllib.parse import urlsplit

import aiohttp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send
from yarl import URL

from relayrl.asgi import StreamState, watch_disconnect
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
_OWN = frozenset({b"date", b"server"})  # the router's server sets its own date
_DROP = _HOP | _OWN
_NOT_FORWARDED = _HOP | {b"expect"}  # the body is read whole before it is forwarded
_KEYS = (b"authorization", b"x-api-key")
_START = frozenset({"/rl/start_session", "/rl/v1/start_session"})
_CHILD = "/rl/v1/child_session"
_BY_ID_BODY = frozenset({"/export_trajectories", "/rl/ack_export", "/rl/abort_session"})
_FAN_SUM = {"/grant_capacity": "capacity"}
_UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)
"""A gateway that failed: connection lost, no byte within the read timeout, or a bad answer."""
_UNREACHABLE = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
"""No connection to the gateway could be opened."""
KEEPALIVE_S = 4.0
"""A connection to a gateway idle this long is not reused: the gateway (uvicorn, 5 s keep-alive
by default) may be closing it just as a request goes out."""


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
    origin: str = field(init=False, repr=False)
    """Scheme, host and port, and the URL's path (put before every forwarded path)."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        self.origin = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"

    def url_for(self, target: bytes) -> URL:
        """The URL of `target` (raw path and query) at this backend, sent as is (no decoding
        and re-encoding)."""
        return URL(self.origin + target.decode("latin-1"), encoded=True)

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


class _Call:
    """One inbound request: its ASGI scope, and the few headers routing reads (one pass)."""

    __slots__ = ("api_key", "authorization", "headers", "length", "method", "path", "scope")

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.path: str = scope["path"]
        self.method: str = scope["method"]
        self.headers: list[tuple[bytes, bytes]] = scope["headers"]
        self.authorization = self.api_key = self.length = None
        for name, value in self.headers:
            name = name.lower()
            if name == b"authorization":
                if self.authorization is None:
                    self.authorization = value
            elif name == b"x-api-key":
                if self.api_key is None:
                    self.api_key = value
            elif name == b"content-length":
                self.length = value

    def key(self, path_key: str | None) -> str | None:
        """The API key the request carries: in its path, `Authorization: Bearer`, `x-api-key`."""
        if path_key:
            return path_key
        auth = (self.authorization or b"").decode("latin-1")
        if auth[:7].lower() == "bearer ":
            return auth[7:].strip() or None
        return self.api_key.decode("latin-1") if self.api_key else None

    def target(self) -> bytes:
        """The raw path and query, as the client sent them (no decoding and re-encoding)."""
        scope = self.scope
        raw = scope.get("raw_path") or self.path.encode()
        query = scope.get("query_string", b"")
        return raw + b"?" + query if query else raw

    def request(self) -> Request:
        """A Starlette view of the request (base URL, query parameters) for the rare routes."""
        return Request(self.scope)


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


def _why(error: Exception) -> str:
    """What failed, in a few words (some errors have no message)."""
    return str(error) or type(error).__name__


class _ClientLeft(Exception):
    """The client left before its request was whole: nothing to forward, no one to answer."""


def _unavailable(message: str) -> EngineError:
    return EngineError(message)  # 503


class _Answer:
    """Something the router answers with: `await answer(scope, receive, send)`, as a Starlette
    response is."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class _Whole(_Answer):
    """A gateway's whole answer, its bytes as they came (headers filtered, length set)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [*self.headers, (b"content-length", str(len(self.body)).encode())]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


class _Stream(_Answer):
    """A gateway's SSE answer, relayed as its bytes arrive (what one socket read brought is
    one chunk). A gateway that breaks off mid-way gets an error frame in the route's format; a
    client that leaves cancels the relay and the gateway connection is closed, so the gateway
    stops generating and notes the call as aborted."""

    __slots__ = ("headers", "path", "response", "status", "url")

    def __init__(self, response: aiohttp.ClientResponse, headers: list[tuple[bytes, bytes]],
                 path: str, url: str) -> None:
        self.response, self.status, self.headers = response, response.status, headers
        self.path, self.url = path, url

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relaying = asyncio.current_task()
        assert relaying is not None  # ASGI apps run in a task
        state = StreamState()
        # one plain task listens for the client leaving (Starlette's StreamingResponse runs an
        # anyio task group per stream for that)
        watcher = asyncio.create_task(watch_disconnect(receive, relaying, state))
        whole = False
        try:
            await send({"type": "http.response.start", "status": self.status,
                        "headers": self.headers})
            ended = True  # at a frame boundary
            try:
                async for chunk in self.response.content.iter_any():  # as each read brings it
                    ended = chunk.endswith(b"\n\n")
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                whole = True
            except _UPSTREAM_ERRORS as e:
                log.warning("stream from %s broke off (%s)", self.url, e)
                frame = stream_error_frame(
                    self.path, _unavailable("the gateway holding this session stopped mid-stream"))
                await send({"type": "http.response.body", "more_body": True,
                            "body": (b"" if ended else b"\n\n") + frame})
            await send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:
            if not state.client_left:
                raise
            relaying.uncancel()
        finally:
            state.done = True
            watcher.cancel()
            if whole:
                self.response.release()  # the connection goes back to the pool
            else:
                self.response.close()  # mid-answer: the gateway sees the client leave


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

    def response(self) -> _Whole:
        return _Whole(self.status, self.headers, self.body)


Answer = _Answer | JSONResponse
"""What a route answers with (a relayed answer, or one the router writes itself)."""


@dataclass
class Router:
    """Backends, bindings and the connection pool to the backends; `app()` serves them."""

    config: RouterConfig
    backends: list[Backend] = field(default_factory=list)
    keys: _Bounded = field(init=False)
    sessions: _Bounded = field(init=False)
    _tenants: dict[str, Tenant] = field(default_factory=dict)
    _turn: itertools.count = field(default_factory=itertools.count)
    _client: aiohttp.ClientSession | None = None

    def __post_init__(self) -> None:
        self.config.validate()
        self.keys = _Bounded(self.config.max_bindings)
        self.sessions = _Bounded(self.config.max_bindings)
        if self.config.tenants:
            self._tenants = {t.key_sha256: t for t in self.config.tenants}
            self.backends = [Backend(u, t) for t in self.config.tenants for u in t.backends]
        else:
            self.backends = [Backend(u.rstrip("/")) for u in self.config.backends]

    def client(self) -> aiohttp.ClientSession:
        """Keep-alive connections to every backend (made on first use, on the running loop)."""
        if self._client is None:
            config = self.config
            self._client = aiohttp.ClientSession(
                # no connection limit: each call in flight holds one connection, as a client
                # of the gateway would
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s,
                                              sock_read=config.read_timeout_s),
                # relay, don't interpret: no decompression, no cookies, no added headers
                auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
        return self._client

    # ------------------------------------------------------------------ who and where

    def caller(self, call: _Call, path_key: str | None) -> Caller:
        """Resolve the request's key to a scope; raise 401 for an unknown key under tenants."""
        key = call.key(path_key)
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

    @staticmethod
    def _headers(call: _Call, caller: Caller) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in call.headers if k.lower() not in _NOT_FORWARDED]
        if caller.tenant is not None and caller.tenant.backend_key:
            headers = [(k, v) for k, v in headers if k.lower() not in _KEYS]
            headers.append((b"authorization", b"Bearer " + caller.tenant.backend_key.encode()))
        return headers

    async def request(self, backend: Backend, method: str, target: bytes,
                      headers: list[tuple[bytes, bytes]], body: bytes) -> aiohttp.ClientResponse:
        """Send one request to `backend`: the answer once its head is in (its body unread).
        `headers` go as given, after `host`, with a content-length for a body or any method
        but GET/HEAD. Raises aiohttp's errors (and TimeoutError)."""
        data = body if body or method not in ("GET", "HEAD") else None
        return await self.client().request(
            method, backend.url_for(target), data=data, allow_redirects=False,
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers])

    async def send(self, backend: Backend, call: _Call, caller: Caller,
                   body: bytes) -> aiohttp.ClientResponse:
        """Send the request to `backend`; the answer once its head is in (its body unread).
        Raises EngineError (503)."""
        try:
            return await self.request(backend, call.method, call.target(),
                                      self._headers(call, caller), body)
        except _UNREACHABLE as e:
            self.mark_down(backend, type(e).__name__)
            raise _unavailable("the gateway for this request is unreachable") from None
        except _UPSTREAM_ERRORS as e:
            raise _unavailable(f"the gateway for this request failed ({_why(e)})") from None

    @staticmethod
    def _answer_headers(response: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in response.raw_headers if k.lower() not in _DROP]

    @staticmethod
    async def _read(response: aiohttp.ClientResponse) -> bytes:
        """The whole body; the connection then goes back to the pool (closed if cut short)."""
        try:
            return await response.read()
        except _UPSTREAM_ERRORS as e:
            response.close()
            raise _unavailable(f"the gateway's answer broke off ({_why(e)})") from None
        except BaseException:
            response.close()
            raise

    async def buffered(self, backend: Backend, call: _Call, caller: Caller,
                       body: bytes) -> _Upstream:
        """The backend's whole answer, raw bytes (no decoding)."""
        response = await self.send(backend, call, caller, body)
        return _Upstream(response.status, self._answer_headers(response),
                         await self._read(response))

    async def relay(self, backend: Backend, call: _Call, caller: Caller, body: bytes) -> _Answer:
        """Forward to `backend` and answer with its bytes: SSE streamed through, others whole."""
        if not backend.healthy:
            raise _unavailable("the gateway holding this session is down; start a new session")
        response = await self.send(backend, call, caller, body)
        headers = self._answer_headers(response)
        for name, value in response.raw_headers:
            if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                return _Stream(response, headers, call.path, backend.url)
        return _Whole(response.status, headers, await self._read(response))

    async def probe(self, scope: list[Backend], call: _Call, caller: Caller, body: bytes,
                    misses: frozenset[int]) -> Answer:
        """Try each healthy backend of `scope` until one answers other than `misses` (a session
        the router has no binding for: started elsewhere, or before a router restart)."""
        ranked = self.ranked(scope)
        if not ranked:
            raise _unavailable("no gateway is available")
        for backend in ranked[:-1]:
            try:
                answer = await self.buffered(backend, call, caller, body)
            except EngineError:
                continue
            if answer.status not in misses:
                return answer.response()
        return await self.relay(ranked[-1], call, caller, body)

    # ------------------------------------------------------------------ routes

    async def start_session(self, call: _Call, caller: Caller, body: bytes) -> Answer:
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
                answer = await self.buffered(backend, call, caller, body)
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
                data["base_url"] = f"{str(call.request().base_url).rstrip('/')}/s/{data['api_key']}/v1"
            return JSONResponse(data)
        if refused is not None:
            return refused.response()
        raise _unavailable("no gateway is available to start a session")

    async def child_session(self, call: _Call, caller: Caller, body: bytes,
                            path_key: str | None) -> Answer:
        """A sub-agent's URL from the session's gateway, pointed at the router: the path the
        gateway gave (from the session key on) under the router's own base URL."""
        answer: Answer
        if caller.owner is not None:
            answer = await self.relay(caller.owner, call, caller, body)
        else:  # a key the router has not bound (a session started elsewhere), or none
            answer = await self.probe(caller.scope, call, caller, body, frozenset({401}))
        key = call.key(path_key)
        if not isinstance(answer, _Whole) or answer.status != 200 or not key:
            return answer
        try:
            data = json.loads(answer.body)
        except ValueError:
            return answer
        url = data.get("base_url") if isinstance(data, dict) else None
        path = urlsplit(url).path if isinstance(url, str) else ""
        start = path.find(f"/s/{key}/")  # the gateway's own root, if any, goes before it
        if start < 0:
            return answer
        data["base_url"] = str(call.request().base_url).rstrip("/") + path[start:]
        return JSONResponse(data)

    async def fan_out(self, call: _Call, caller: Caller,
                      body: bytes) -> tuple[list[tuple[Backend, Any]], Answer | None, int]:
        """Send to every healthy backend of the caller's scope: answers, the first failure, and
        how many backends were unreachable."""
        ranked = [b for b in caller.scope if b.healthy]
        results = await asyncio.gather(*(self.buffered(b, call, caller, body) for b in ranked),
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

    async def list_sessions(self, call: _Call, caller: Caller, body: bytes) -> Answer:
        """`/rl/sessions` of every backend, merged (and each session's owner remembered)."""
        answers, failed, unreachable = await self.fan_out(call, caller, body)
        if failed is not None:
            return failed
        merged = []
        for backend, data in answers:
            for s in data.get("sessions", []):
                if isinstance(s, dict) and isinstance(s.get("session_id"), str):
                    self.sessions.bind(s["session_id"], backend)
                merged.append(s)
        limit = call.request().query_params.get("limit", "1000")
        result: dict[str, Any] = {"sessions": merged[: int(limit)] if limit.isdigit() else merged}
        if unreachable:
            result["unreachable_backends"] = unreachable
        return JSONResponse(result)

    async def set_version(self, call: _Call, caller: Caller, body: bytes) -> Answer:
        """Announce a weight version to every backend; the lowest version they report back."""
        answers, failed, unreachable = await self.fan_out(call, caller, body)
        if failed is not None:
            return failed
        result = {"version": min(d["version"] for _, d in answers),
                  "capacity": sum(d.get("capacity", 0) for _, d in answers),
                  "backends": len(answers)}
        if unreachable:
            result["unreachable_backends"] = unreachable
        return JSONResponse(result)

    async def grant_capacity(self, call: _Call, caller: Caller, body: bytes) -> Answer:
        """Capacity summed over the backends."""
        answers, failed, _ = await self.fan_out(call, caller, body)
        if failed is not None:
            return failed
        return JSONResponse({"capacity": sum(d.get("capacity", 0) for _, d in answers)})

    async def status(self, call: _Call, caller: Caller, body: bytes) -> Answer:
        """`/rl/v1/status` over the caller's backends: counts summed, the oldest policy version."""
        answers, failed, unreachable = await self.fan_out(call, caller, body)
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

    def health(self) -> JSONResponse:
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

    async def read_body(self, call: _Call, receive: Receive) -> bytes:
        """The request body, refused (413) past `max_body_bytes` without reading it all."""
        limit = self.config.max_body_bytes
        declared = call.length
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes")
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientLeft
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):  # the usual case: one message
            if len(body) > limit:
                raise PayloadTooLarge(f"request body over {limit} bytes")
            return body
        parts, size = [body], len(body)
        while message.get("more_body", False):  # ends with the body, or a disconnect
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft  # a cut body must not reach a gateway as a whole one
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body over {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def dispatch(self, call: _Call, receive: Receive) -> Answer:
        """Route one request (see the module docstring)."""
        path = call.path
        if path == "/health" and call.method == "GET":
            return self.health()
        path_key = None
        if path.startswith("/s/"):
            path_key = path.split("/", 3)[2]
        caller = self.caller(call, path_key)
        body = await self.read_body(call, receive)
        if path in _START:
            return await self.start_session(call, caller, body)
        if path.endswith(_CHILD) and path in (_CHILD, f"/s/{path_key}{_CHILD}"):
            return await self.child_session(call, caller, body, path_key)
        if caller.owner is not None and not path.startswith("/sessions/"):
            return await self.relay(caller.owner, call, caller, body)
        if path == "/rl/v1/status":
            return await self.status(call, caller, body)
        if path == "/rl/sessions":
            return await self.list_sessions(call, caller, body)
        if path == "/rl/v1/set_version":
            return await self.set_version(call, caller, body)
        if path in _FAN_SUM:
            return await self.grant_capacity(call, caller, body)
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
                return await self.relay(owner, call, caller, body)
            if caller.owner is not None:  # a session key naming another session
                raise NotFound(f"unknown session {session_id!r}")
            return await self.probe(caller.scope, call, caller, body, frozenset({404}))
        if caller.keyed and caller.tenant is None:
            # a key the router has not bound: a session started elsewhere, or the admin key
            return await self.probe(caller.scope, call, caller, body, frozenset({401}))
        ranked = self.ranked(caller.scope)
        if not ranked:
            raise _unavailable("no gateway is available")
        return await self.relay(ranked[0], call, caller, body)

    async def endpoint(self, call: _Call, receive: Receive) -> Answer:
        """Dispatch, with errors in the route's own format."""
        try:
            return await self.dispatch(call, receive)
        except RelayError as e:
            return error_response(call.path, e)

    # ------------------------------------------------------------------ health checks

    async def check(self, backend: Backend) -> None:
        """One health check of `backend`."""
        try:
            async with asyncio.timeout(self.config.health_timeout_s):
                response = await self.request(backend, "GET", b"/health", [], b"")
                try:
                    raw = await response.read()
                finally:
                    response.close()  # a no-op once read whole (the connection is back)
            data = json.loads(raw) if response.status == 200 else None
            ok = isinstance(data, dict)
        except (*_UPSTREAM_ERRORS, TimeoutError, ValueError):
            ok, data = False, None
        if ok:
            assert isinstance(data, dict)
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

    async def aclose(self) -> None:
        """Close the connections to the backends (a later call opens new ones)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Run health checks for the app's lifetime; close the connections after."""
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
            await self.aclose()

    def app(self) -> Starlette:
        """The ASGI app: every method on every path goes to `endpoint`."""
        app = _RouterApp(self, lifespan=self.lifespan)
        app.state.router = self
        return app


class _RouterApp(Starlette):
    """Starlette for the lifespan and `app.state`; HTTP requests go straight to the router's one
    endpoint as raw ASGI, skipping the middleware stack, route matching and request object a
    single catch-all route does not need."""

    def __init__(self, router: Router, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._relay = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        call = _Call(scope)
        try:
            answer = await self._relay.endpoint(call, receive)
        except _ClientLeft:
            return
        except Exception:  # what Starlette's error middleware would do, in the route's format
            log.exception("router error on %s %s", call.method, call.path)
            answer = error_response(call.path, RelayError("internal router error"))
        await answer(scope, receive, send)


def create_app(config: RouterConfig) -> Starlette:
    """A router app for `config` (its `Router` is on `app.state.router`)."""
    return Router(config).app()
