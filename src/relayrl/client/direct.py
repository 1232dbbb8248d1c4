"""`DirectClient`: a real `openai.AsyncOpenAI` bound to one gateway session, made from an engine.

For code that hands a client object to its agent (AReaL's "direct approach"):
`DirectClient(engine=engine, tokenizer=tokenizer)` inside `arun_episode`, where `engine` is the
`RunEngine` the episode was handed. Every call goes through the run's gateway (same routes,
renderer and session as an agent over HTTP), so it is recorded token-exact with the engine's
weight version. `DirectClient.open(app)` binds one to an in-process gateway app instead (no
port). The OpenAI client is wrapped, not subclassed; `.chat`, `.responses`, `.models` are its own.

The session is opened on the first call (the constructor is synchronous, as the seed writes it),
tagged with the running episode when there is one.

Rewards: `set_reward(id, r)` and `set_last_reward(r)` work called plainly, as the seed does:
the reward is checked at once and queued, and the queue is sent to the gateway, in order, before
the next call, the export or `flush_rewards()`. Awaiting them sends at once (and raises there
if the gateway refuses, e.g. an unknown id). A queued reward is never dropped: it is sent, or
the export raises. `apply_reward_discount(turn_discount=γ)` sets the discount the export
applies; `export_interactions(style=...)` ends the session and returns its rows as a dict of
`TrajectoryRow` keyed by interaction id (awaitable too), which `arun_episode` may return as is.
It waits for the run's gateway (on its own thread) from a private event loop, so the plain call
works inside `arun_episode`; `aexport_interactions` awaits on the caller's loop instead.

Closing the client frees its session: acknowledged when its rows were exported (the caller has
them), aborted otherwise. Clients made inside an episode are closed by the episode runner when
the episode ends, so a raising episode leaves no session open. Tradeoff: over an ASGI app the
transport buffers each response, so a streamed reply arrives all at once.

openai (and httpx2, the HTTP client it is built on) are imported when a `DirectClient` is made,
so `import relayrl.client` works without the `agents` extra.

May import: httpx, `relayrl.client`, `relayrl.errors`, `relayrl.trajectory`; openai/httpx2 only
inside `DirectClient`. Never the gateway's modules (it is handed an app or a URL).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
from collections.abc import Coroutine, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from relayrl.client.engine import RunEngine
from relayrl.client.session_client import SessionClient, SessionHandle
from relayrl.errors import CapacityExhausted, ConfigError, InvalidRequest, RelayError, SessionClosed
from relayrl.trajectory import (
    DEFAULT_CREDIT_RULE,
    DEFAULT_EXPORT_STYLE,
    SCHEMA_VERSION,
    TrajectoryRow,
    row_from_dict,
)

log = logging.getLogger(__name__)

_BASE = "http://relayrl.direct"
_CAPACITY_WAIT_S = 60.0
_CAPACITY_POLL_S = 0.25
_EXPORT_TIMEOUT_S = 300.0

_EPISODE_CLIENTS: contextvars.ContextVar[list[DirectClient] | None] = contextvars.ContextVar(
    "relayrl_direct_clients", default=None)
_EPISODE_META: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "relayrl_direct_meta", default=None)


@contextlib.contextmanager
def episode_clients(metadata: dict[str, Any] | None = None) -> Iterator[list[DirectClient]]:
    """Collect the DirectClients made in the enclosed code (one episode), for `close_clients`;
    their sessions are tagged with `metadata` (the episode's ids)."""
    made: list[DirectClient] = []
    token = _EPISODE_CLIENTS.set(made)
    meta_token = _EPISODE_META.set(metadata)
    try:
        yield made
    finally:
        _EPISODE_META.reset(meta_token)
        _EPISODE_CLIENTS.reset(token)


async def close_clients(clients: list[DirectClient]) -> None:
    """Close every client (unexported sessions are aborted); errors are logged, not raised."""
    for client in clients:
        try:
            await client.aclose()
        except Exception as e:  # the episode's outcome is decided; a failed release is not it
            log.warning("closing a DirectClient: %s: %s", type(e).__name__, e)


_REPLY_PREFIXES = ("chatcmpl-", "resp_", "msg_")
"""What each wire puts before the call id in its reply ids (the gateway's wires say the same)."""


def _call_id(key: str) -> str:
    for prefix in _REPLY_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


class Interactions(dict[str, TrajectoryRow]):
    """Exported rows keyed by interaction id; a reply's own id (`response.id`, with its wire's
    prefix) finds its row too."""

    def __getitem__(self, key: str) -> TrajectoryRow:
        return super().__getitem__(_call_id(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(_call_id(key) if isinstance(key, str) else key)

    def get(self, key: str, default: Any = None) -> Any:
        """The row of `key` (an interaction or reply id), else `default`."""
        return super().get(_call_id(key), default)

    def __await__(self) -> Generator[Any, None, Interactions]:
        """Already here: awaiting gives the same dict (for code that awaits the export)."""
        return self
        yield  # a generator: `await` returns at once


class PendingExport:
    """An export still to be awaited (`DirectClient.open` clients); not a dict until then."""

    def __init__(self, export: Coroutine[Any, Any, Interactions]) -> None:
        self._export = export

    def __await__(self) -> Generator[Any, None, Interactions]:
        return self._export.__await__()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"export_interactions() of a client bound to an in-process app must be "
                        f"awaited before use (.{name}): `await client.export_interactions()`")

    def __iter__(self) -> Iterator[str]:
        raise TypeError("export_interactions() of a client bound to an in-process app must be "
                        "awaited before use: `await client.export_interactions()`")

    def __len__(self) -> int:
        raise TypeError("export_interactions() of a client bound to an in-process app must be "
                        "awaited before use: `await client.export_interactions()`")


class RewardCall:
    """What `set_reward` / `set_last_reward` return: the reward is already queued; awaiting
    this sends the queue now (and raises here if the gateway refuses it)."""

    def __init__(self, client: DirectClient) -> None:
        self._client = client

    def __await__(self) -> Generator[Any, None, None]:
        return self._client.flush_rewards().__await__()


class DirectClient:
    """An OpenAI client bound to one session of the run's gateway (or of an in-process app)."""

    def __init__(self, engine: RunEngine | None = None, tokenizer: Any = None, *,
                 app: Any = None, session: SessionHandle | None = None,
                 admin: SessionClient | None = None, task_id: str | None = None,
                 metadata: dict[str, Any] | None = None) -> None:
        # optional: the `agents` extra; openai's own client is httpx2
        import httpx2
        from openai import AsyncOpenAI

        if engine is not None:
            if not isinstance(engine, RunEngine):
                raise ConfigError(
                    f"DirectClient(engine=...) takes the engine arun_episode was handed (a "
                    f"RunEngine), got a {type(engine).__name__}; outside a run, use "
                    "DirectClient.open(app) on a gateway app, or RunEngine(engine, sessions=...)")
            if engine.sessions is None:
                raise ConfigError("DirectClient(engine=...): this engine has no gateway to "
                                  "record calls in (RunEngine(..., sessions=SessionClient(...)))")
            admin, app = engine.sessions, engine.app if app is None else app
        if admin is None:
            raise ConfigError("DirectClient needs engine= (in arun_episode) or "
                              "DirectClient.open(app)")
        self.engine = engine
        self.tokenizer = tokenizer
        """Kept for code that reads it back; the gateway renders with the model's own."""
        self.app = app
        self._admin = admin
        self.session = session
        self._task_id = task_id
        self._metadata = metadata if metadata is not None else _EPISODE_META.get()
        base = _BASE if app is not None else admin.gateway_url
        transport = httpx2.ASGITransport(app=app) if app is not None else None
        self._http = httpx2.AsyncClient(transport=transport, base_url=base, timeout=None,
                                        event_hooks={"request": [self._before_request]})
        # the key goes in per request (the session opens on the first call)
        self.openai = AsyncOpenAI(base_url=f"{base}/v1", api_key="relayrl-direct",
                                  http_client=self._http, max_retries=0)
        self._opening: asyncio.Lock | None = None
        self._pending: list[tuple[str | None, float]] = []
        self._calls = 0
        self._discount = 1.0
        self._exported: Interactions | None = None
        self._closed = False
        made = _EPISODE_CLIENTS.get()
        if made is not None:
            made.append(self)

    @classmethod
    async def open(cls, app: Any, task_id: str | None = None,
                   metadata: dict[str, Any] | None = None) -> DirectClient:
        """Start a session on the in-process gateway `app` and return a client bound to it."""
        admin_key = app.state.deps.config.admin_key
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=_BASE)
        admin = SessionClient(_BASE, admin_key=admin_key, http_client=http)
        session = await admin.start_session(task_id=task_id, metadata=metadata)
        return cls(app=app, session=session, admin=admin)

    def __getattr__(self, name: str) -> Any:
        if name == "openai":  # not set yet: the constructor failed before making it
            raise AttributeError(name)
        return getattr(self.openai, name)

    # ---- the session ----------------------------------------------------------------------

    async def _session(self) -> SessionHandle:
        """The client's session, opened (waiting, bounded, for gateway capacity) on first use."""
        if self.session is not None:
            return self.session
        if self._closed:
            raise SessionClosed("this DirectClient is closed")
        self._opening = self._opening or asyncio.Lock()
        async with self._opening:
            for _ in range(int(_CAPACITY_WAIT_S / _CAPACITY_POLL_S) + 1):  # bounded wait
                if self.session is not None:
                    break
                with contextlib.suppress(CapacityExhausted):
                    self.session = await self._admin.start_session(self._task_id,
                                                                   self._metadata)
                    break
                await asyncio.sleep(_CAPACITY_POLL_S)
        if self.session is None:
            raise CapacityExhausted(f"the gateway granted no session within {_CAPACITY_WAIT_S} s")
        return self.session

    async def _before_request(self, request: Any) -> None:
        session = await self._session()
        if self._pending:
            await self.flush_rewards()  # earlier rewards go to the calls made before them
        request.headers["authorization"] = f"Bearer {session.api_key}"
        self._calls += 1

    # ---- rewards --------------------------------------------------------------------------

    def set_reward(self, interaction_id: str, reward: float) -> RewardCall:
        """Reward one call by its id (the `id` of the completion/response/message).

        Works called plainly (queued, sent before the next call or the export) or awaited
        (sent now)."""
        self._queue(str(interaction_id), reward)
        return RewardCall(self)

    def set_last_reward(self, reward: float) -> RewardCall:
        """Reward the last call made so far (plainly or awaited, as `set_reward`)."""
        if not self._calls and self.session is None:
            raise InvalidRequest("set_last_reward: this client has made no call yet")
        self._queue(None, reward)
        return RewardCall(self)

    def _queue(self, interaction_id: str | None, reward: float) -> None:
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise InvalidRequest(f"a reward must be a number, got {type(reward).__name__}")
        if not math.isfinite(reward):
            raise InvalidRequest(f"a reward must be finite, got {reward}")
        if self._exported is not None:
            raise SessionClosed("the session was exported; rewards set now would be lost")
        self._pending.append((interaction_id, float(reward)))

    async def flush_rewards(self) -> None:
        """Send the queued rewards to the gateway, in the order they were set."""
        session = await self._session()
        while self._pending:
            interaction_id, reward = self._pending[0]
            await self._admin.set_reward(session, reward, interaction_id)
            self._pending.pop(0)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> None:
        """Discount rewards back through the conversation by `turn_discount` at export: a call's
        reward becomes its own plus `turn_discount` times its children's mean."""
        if not 0.0 <= turn_discount <= 1.0:
            raise InvalidRequest(f"turn_discount must be in [0, 1], got {turn_discount}")
        self._discount = float(turn_discount)

    # ---- export ---------------------------------------------------------------------------

    def export_interactions(self, style: str = DEFAULT_EXPORT_STYLE,
                            discount: float | None = None, credit: str = DEFAULT_CREDIT_RULE
                            ) -> Interactions | PendingExport:
        """End the session and return its rows keyed by interaction id (queued rewards are sent
        first); `discount` defaults to the one `apply_reward_discount` set.

        On a run's gateway (a URL) the rows come back at once, as a dict, which may also be
        awaited. A client bound to an in-process app (`open`) cannot wait for that app without
        blocking it: there this returns a `PendingExport` to await (or to return from
        `arun_episode`, which awaits it), and using it as a dict raises."""
        discount = self._discount if discount is None else discount
        if self._exported is not None:
            return self._exported
        if self.app is not None:
            return PendingExport(self.aexport_interactions(style, discount, credit))
        if self.session is None and not self._calls:
            return self._nothing_to_export()
        # the gateway answers on its own thread: wait for it from a private loop
        with ThreadPoolExecutor(1, thread_name_prefix="relayrl-export") as pool:
            return pool.submit(asyncio.run, self._export_from(style, discount, credit)).result()

    async def aexport_interactions(self, style: str = DEFAULT_EXPORT_STYLE,
                                   discount: float | None = None,
                                   credit: str = DEFAULT_CREDIT_RULE) -> Interactions:
        """`export_interactions`, awaited on this event loop (works for any client)."""
        discount = self._discount if discount is None else discount
        if self._exported is not None:
            return self._exported
        if self.session is None and not self._calls:
            return self._nothing_to_export()
        await self.flush_rewards()
        return await self._end_and_export(self._admin, style, discount, credit)

    def _nothing_to_export(self) -> Interactions:
        self._exported = Interactions()  # no call, no session: nothing to train on
        return self._exported

    async def _export_from(self, style: str, discount: float, credit: str) -> Interactions:
        """Flush and export through a client of this (private) loop."""
        async with SessionClient(self._admin.gateway_url, admin_key=self._admin.admin_key,
                                 timeout_s=_EXPORT_TIMEOUT_S) as admin:
            session = await self._session_with(admin)
            while self._pending:
                interaction_id, reward = self._pending[0]
                await admin.set_reward(session, reward, interaction_id)
                self._pending.pop(0)
            return await self._end_and_export(admin, style, discount, credit)

    async def _session_with(self, admin: SessionClient) -> SessionHandle:
        if self.session is None:
            raise SessionClosed("this DirectClient has no session to export")
        return self.session

    async def _end_and_export(self, admin: SessionClient, style: str, discount: float,
                              credit: str) -> Interactions:
        session = await self._session_with(admin)
        with contextlib.suppress(SessionClosed):  # already ended is fine
            await admin.end_session(session)
        rows = await admin.export(session.session_id, style=style, credit=credit,
                                  discount=discount)
        parsed = [row_from_dict({"schema_version": SCHEMA_VERSION, **r}) for r in rows]
        self._exported = Interactions((r.interaction_ids[-1], r) for r in parsed)
        return self._exported

    # ---- closing --------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Free the session (acknowledged if exported, else aborted); close the HTTP clients."""
        if self._closed:
            return
        self._closed = True
        if self.session is not None:
            release = (self._admin.ack_export if self._exported is not None
                       else self._admin.abort_session)
            if self._pending and self._exported is None:
                log.info("DirectClient closed with %d unsent rewards: its session is aborted "
                         "(never trained on)", len(self._pending))
            with contextlib.suppress(RelayError):  # already freed (or expired): nothing to do
                await release(self.session.session_id)
        await self.openai.close()
        if self.engine is None:  # a client of open(): the admin client is its own
            await self._admin.http.aclose()

    async def __aenter__(self) -> DirectClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
