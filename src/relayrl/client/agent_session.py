"""`AgentSession`: every LLM call made inside a `with` block lands in one training session.

`async with AgentSession() as s:` (or a plain `with`) starts a session on a relayrl service and,
until the block ends, adds the session's key to every HTTP request that goes to the service's
origin, whichever client makes it: the openai and anthropic SDKs (httpx/httpx2 underneath), plain
httpx, and aiohttp. The agent's code does not change. The binding lives in a `ContextVar`, so
concurrent sessions in one process (tasks, or threads that copy their context) never mix, and
requests to any other host are left exactly as they were.

How: the default transports' `handle_request` / `handle_async_request` of httpx and httpx2, and
`aiohttp.ClientSession._request`, are wrapped once per process (idempotently). A wrapped call
looks at the current binding and, for a request to the bound origin, sets `Authorization:
Bearer <session key>` (and `x-api-key`, if the request carries one). Admin routes (starting
sessions, export) are never rewritten. Tradeoff: work handed to a thread without copying the
context (`loop.run_in_executor`, a bare `threading.Thread`) is not in the session; use
`asyncio.to_thread`, which copies it, or pass `s.base_url` / `s.api_key` explicitly.

Imports: httpx (and httpx2, aiohttp when installed), relayrl.errors, relayrl.client.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from relayrl.client import protocol
from relayrl.errors import ConfigError, RelayError, SessionClosed

log = logging.getLogger(__name__)

URL_ENV = ("RELAYRL_URL", "OPENAI_BASE_URL")
"""Where the service is, when no `base_url` is given: the first of these that is set."""
KEY_ENV = "RELAYRL_API_KEY"
"""The service's key (needed when it was started with one), when no `api_key` is given."""

ADMIN_PATHS = ("/rl/v1/start_session", "/rl/start_session", "/export_trajectories",
               "/rl/ack_export", "/rl/abort_session", "/grant_capacity", "/health",
               "/rl/v1/status")
"""Routes that take the service's key, not a session's: requests to them are never rewritten."""

_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class _Binding:
    """Which requests belong to the current session: those to `origin` under `path_prefix`."""

    origin: tuple[str, str, int]
    path_prefix: str
    key: str

    def covers(self, scheme: str, host: str | None, port: int | None, path: str) -> bool:
        scheme = scheme.lower()
        port = port if port is not None else _DEFAULT_PORTS.get(scheme, 0)
        if (scheme, (host or "").lower(), port) != self.origin:
            return False
        if not path.startswith(self.path_prefix):
            return False
        return not path.rstrip("/").endswith(ADMIN_PATHS)


_current: contextvars.ContextVar[_Binding | None] = contextvars.ContextVar(
    "relayrl_agent_session", default=None)


def _origin(url: str) -> tuple[tuple[str, str, int], str]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ConfigError(f"service URL {url!r} must be an http(s) URL with a host")
    port = parts.port if parts.port is not None else _DEFAULT_PORTS[scheme]
    return (scheme, parts.hostname.lower(), port), parts.path.rstrip("/")


# ---- the patches -------------------------------------------------------------------------------

_install_lock = threading.Lock()
_MARK = "__relayrl_agent_session__"


def _rewrite_httpx(request: Any) -> None:
    binding = _current.get()
    if binding is None:
        return
    url = request.url
    if not binding.covers(url.scheme, url.host, url.port, url.path):
        return
    request.headers["authorization"] = f"Bearer {binding.key}"
    if "x-api-key" in request.headers:
        request.headers["x-api-key"] = binding.key


def _patch_httpx_module(mod: Any) -> None:
    sync_cls, async_cls = mod.HTTPTransport, mod.AsyncHTTPTransport
    if not getattr(sync_cls.handle_request, _MARK, False):
        original_sync = sync_cls.handle_request

        def handle_request(self: Any, request: Any) -> Any:
            _rewrite_httpx(request)
            return original_sync(self, request)

        setattr(handle_request, _MARK, True)
        sync_cls.handle_request = handle_request
    if not getattr(async_cls.handle_async_request, _MARK, False):
        original_async = async_cls.handle_async_request

        async def handle_async_request(self: Any, request: Any) -> Any:
            _rewrite_httpx(request)
            return await original_async(self, request)

        setattr(handle_async_request, _MARK, True)
        async_cls.handle_async_request = handle_async_request


def _patch_aiohttp(aiohttp: Any) -> None:
    cls = aiohttp.ClientSession
    if getattr(cls._request, _MARK, False):
        return
    original = cls._request
    from multidict import CIMultiDict
    from yarl import URL

    async def _request(self: Any, method: str, str_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        binding = _current.get()
        if binding is not None:
            url = self._build_url(str_or_url) if hasattr(self, "_build_url") else URL(str_or_url)
            if binding.covers(url.scheme, url.host, url.port, url.path):
                headers = CIMultiDict(kwargs.get("headers") or {})
                headers["Authorization"] = f"Bearer {binding.key}"
                if "x-api-key" in headers:
                    headers["x-api-key"] = binding.key
                kwargs["headers"] = headers
        return await original(self, method, str_or_url, *args, **kwargs)

    setattr(_request, _MARK, True)
    cls._request = _request


def install() -> None:
    """Wrap the HTTP clients' send paths so calls inside an AgentSession carry its key (once)."""
    with _install_lock:
        _patch_httpx_module(httpx)
        try:
            import httpx2
        except ImportError:
            pass
        else:
            _patch_httpx_module(httpx2)
        try:
            import aiohttp
        except ImportError:
            pass
        else:
            _patch_aiohttp(aiohttp)


@contextlib.contextmanager
def _unbound() -> Iterator[None]:
    # the session's own control calls carry their key explicitly; an enclosing (or nested)
    # binding must not replace it
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


# ---- the session -------------------------------------------------------------------------------


def resolve_service(base_url: str | None, api_key: str | None) -> tuple[str, str | None]:
    """The service's root URL and key, from the arguments or the environment (see URL_ENV)."""
    source = "argument"
    if base_url is None:
        for name in URL_ENV:
            if os.environ.get(name):
                base_url, source = os.environ[name], name
                break
    if not base_url:
        raise ConfigError("no service URL: pass base_url, or set RELAYRL_URL or OPENAI_BASE_URL")
    root = base_url.rstrip("/")
    if root.endswith("/v1"):  # an OpenAI-style base URL names the service's /v1
        root = root[:-3]
    _origin(root)  # validates
    if api_key is None:
        api_key = os.environ.get(KEY_ENV) or None
        # OPENAI_API_KEY goes only where OPENAI_BASE_URL points: never to another host
        if api_key is None and source == "OPENAI_BASE_URL":
            api_key = os.environ.get("OPENAI_API_KEY") or None
    return root, api_key


class AgentSession:
    """One trajectory: `async with AgentSession() as s:` (or `with`); see the module docstring.

    `api_key` is the *service's* key (to start sessions); `s.api_key` is the session's own key.
    Leaving the block finalizes the session (with `s.reward`, if set); leaving it with an
    exception aborts it, so a crashed episode is never trained on.
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None,
                 group_id: str | None = None, metadata: dict[str, Any] | None = None, *,
                 start_wait_s: float = 300.0, timeout_s: float = 60.0) -> None:
        self.root_url, self._service_key = resolve_service(base_url, api_key)
        self.group_id = group_id
        self.metadata = metadata
        self.start_wait_s = start_wait_s
        self.timeout_s = timeout_s
        self.reward: float | None = None
        """The final reward the block's exit finalizes with (set it, or call `set_reward`)."""
        self.session_id: str | None = None
        self.start_waits = 0
        """How many times start_session answered 429 before this session started."""
        self.state = "new"
        self._key: str | None = None
        self._base_url: str | None = None
        self._token: contextvars.Token[_Binding | None] | None = None
        self._sync: bool | None = None
        self._finalized: dict[str, Any] | None = None
        install()

    # ---- what agents elsewhere need ----

    @property
    def api_key(self) -> str:
        """The session's key (a secret): as an OpenAI/Anthropic API key it reaches this session."""
        if self._key is None:
            raise SessionClosed("the session has not started")
        return self._key

    @property
    def base_url(self) -> str:
        """An OpenAI-style base URL that reaches this session by path (it holds the key)."""
        if self._base_url is None:
            raise SessionClosed("the session has not started")
        return self._base_url

    def env(self) -> dict[str, str]:
        """Environment for an agent in another process: OPENAI_BASE_URL and OPENAI_API_KEY."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key}

    # ---- running the protocol's operations (relayrl.client.protocol) ----

    async def _run(self, op: protocol.Operation[protocol.T]) -> protocol.T:
        async with httpx.AsyncClient(timeout=self.timeout_s) as c:
            with _unbound():
                return await protocol.run_async(op, c, self.root_url)

    def _run_sync(self, op: protocol.Operation[protocol.T]) -> protocol.T:
        with httpx.Client(timeout=self.timeout_s) as c, _unbound():
            return protocol.run_sync(op, c, self.root_url)

    def _start_op(self) -> protocol.Operation[tuple[protocol.SessionHandle, int]]:
        return protocol.start_session(self._service_key, self.group_id, self.metadata,
                                      wait_s=self.start_wait_s)

    def _abort_op(self, exc_type: Any, exc: Any) -> protocol.Operation[dict[str, Any]]:
        return protocol.abort(self.api_key, _reason(exc_type, exc))

    # ---- async use ----

    def _once(self, sync: bool) -> None:
        if self._sync is not None:
            raise SessionClosed("an AgentSession is entered once; make a new one per episode")
        self._sync = sync

    async def __aenter__(self) -> AgentSession:
        self._once(False)
        self._started(*await self._run(self._start_op()))
        self._bind()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is not None:
                try:
                    self._answer(await self._run(self._abort_op(exc_type, exc)))
                except (httpx.HTTPError, RelayError) as e:
                    self._abort_failed(e)
            elif self._finalized is None:
                await self._finalize(self.reward)
        finally:
            self._unbind()

    async def _finalize(self, reward: float | None) -> dict[str, Any]:
        self._finalized = self._answer(await self._run(protocol.finalize(self.api_key, reward)))
        self._check_final(reward)
        return self._finalized

    # ---- sync use ----

    def __enter__(self) -> AgentSession:
        self._once(True)
        self._started(*self._run_sync(self._start_op()))
        self._bind()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is not None:
                try:
                    self._answer(self._run_sync(self._abort_op(exc_type, exc)))
                except (httpx.HTTPError, RelayError) as e:
                    self._abort_failed(e)
            elif self._finalized is None:
                self._sync_finalize(self.reward)
        finally:
            self._unbind()

    def _sync_finalize(self, reward: float | None) -> dict[str, Any]:
        self._finalized = self._answer(self._run_sync(protocol.finalize(self.api_key, reward)))
        self._check_final(reward)
        return self._finalized

    # ---- rewards: awaitable inside `async with`, immediate inside `with` ----

    def set_reward(self, reward: float, completion_id: str | None = None) -> Any:
        """Reward one call by its reply id now, or (no id) set the final reward used at exit."""
        if completion_id is None:
            self.reward = float(reward)
            return _done(None) if not self._sync else None
        op = protocol.set_reward(self.api_key, reward, completion_id)
        if self._sync:
            return self._answer(self._run_sync(op))

        async def go() -> dict[str, Any]:
            return self._answer(await self._run(op))
        return go()

    def finalize(self, reward: float | None = None) -> Any:
        """End the trajectory now with an optional final reward (a second finalize is a no-op)."""
        final = self.reward if reward is None else float(reward)
        if self._sync:
            return self._sync_finalize(final)
        return self._finalize(final)

    # ---- shared ----

    def _started(self, handle: protocol.SessionHandle, waits: int) -> None:
        self.start_waits = waits
        self.session_id = handle.session_id
        self._key = handle.api_key
        self._base_url = handle.base_url
        self.state = "open"

    def _abort_failed(self, err: Exception) -> dict[str, Any]:
        # the block is already failing with its own exception: say why the abort did not take
        # rather than mask it (an open session the service cannot reach expires by its TTL, and
        # an expired session is aborted too)
        log.warning("session %s: abort failed: %s: %s", self.session_id, type(err).__name__, err)
        return {}

    def _answer(self, data: dict[str, Any]) -> dict[str, Any]:
        if "state" in data:
            self.state = data["state"]
        return data

    def _check_final(self, reward: float | None) -> None:
        done = self._finalized or {}
        if done.get("already_finalized") and reward is not None and done.get("final_reward") != reward:
            log.warning("session %s was already finalized with reward %s; %s was not applied",
                        self.session_id, done.get("final_reward"), reward)

    def _bind(self) -> None:
        origin, prefix = _origin(self.root_url)
        self._token = _current.set(_Binding(origin, prefix, self.api_key))

    def _unbind(self) -> None:
        if self._token is None:
            return
        try:
            _current.reset(self._token)
        except ValueError:  # exited in another context than entered: just clear it there
            _current.set(None)
        self._token = None


def current() -> str | None:
    """The key of the session the calling context is in, or None."""
    binding = _current.get()
    return binding.key if binding is not None else None


def _reason(exc_type: Any, exc: Any) -> str:
    # the type only: an exception's message may hold the agent's data, which stays here
    return str(getattr(exc_type, "__name__", "error"))[:200]


def _done(value: Any) -> Awaitable[Any]:
    # an already-finished future: awaiting it is optional (no "never awaited" warning)
    try:
        future = asyncio.get_running_loop().create_future()
    except RuntimeError:  # not in a loop (set_reward before the block): nothing to await
        return None  # type: ignore[return-value]  # typed for the usual in-loop call
    future.set_result(value)
    return future


__all__ = ["AgentSession", "current", "install", "resolve_service"]
