"""The session API: capacity, sessions, rewards, end, finalize, abort, export, versions, status.

One handler per operation. An operation's spellings, `/rl/...` and `/rl/v1/...` (and
`/s/{session_key}/rl/v1/...` for those a session's own key reaches), are aliases: `ROUTES` is
the one table of them that `register` adds, and docs/protocol.md shows it as one table.

Admin routes need the admin key; reward, end, finalize and abort need the session's own key.
Bodies are validated by small pydantic models so a bad field is a 400/422 in OpenAI's error
shape. Export styles and credit rules are `relayrl.trajectory`'s enums, defaults included (one
definition). What the routes keep between requests (finalized keys, recent rewards, the
admission hook a service installs) is a `V1State` on `app.state.rl_v1`.

May import: FastAPI/Starlette, pydantic, `relayrl.errors`, `relayrl.chat` (error bodies),
`relayrl.trajectory` and the gateway modules below the app (`auth`, `bodies`, `core`, `wires`);
never `gateway.app` (it registers these).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator

import relayrl
from relayrl.chat import wire_openai_chat
from relayrl.errors import AuthenticationFailed, CapacityExhausted, InvalidRequest, SessionClosed
from relayrl.gateway.auth import (
    NO_SESSION,
    check_chosen_key,
    request_key,
    require_admin,
    require_session,
)
from relayrl.gateway.bodies import read_model
from relayrl.gateway.core import GatewayDeps
from relayrl.gateway.wires import interaction_id
from relayrl.trajectory import (
    DEFAULT_CREDIT_RULE,
    DEFAULT_EXPORT_STYLE,
    CreditRule,
    ExportStyle,
    Session,
    SessionState,
    export_session,
    row_to_dict,
)
from relayrl.trajectory.roles import check_role
from relayrl.trajectory.session import hash_key as _key_hash

SESSION_PREFIX = "/s/{session_key}"
"""Key-addressed session root: `{root}/s/{key}/v1` is an OpenAI-style base URL of the session."""

ROLE_PREFIX = SESSION_PREFIX + "/role/{role}"
"""A role-scoped root of a session: every call under `{root}/s/{key}/role/{role}/v1` is recorded
in the session under `role` (with `gateway.roles` on; `child_session` hands them out)."""

RETIRED_KEYS = 1 << 16
"""Finalized sessions remembered after the store forgets them (so a late finalize stays a no-op)."""

RECENT_REWARDS = 100
"""Final rewards averaged by `/rl/v1/status`."""


@dataclass(frozen=True)
class Refusal:
    """Why `start_session` is refused now, and when to ask again."""

    retry_after_s: float
    reason: str = "the trainer is behind"


Admission = Callable[[GatewayDeps], "Refusal | float | None"]
"""Decides whether a session may start now: None admits; a `Refusal` (or a number of seconds,
meaning the trainer is behind) refuses with a 429 and `Retry-After`."""


@dataclass
class _Finalized:
    session_id: str
    final_reward: float | None


@dataclass
class V1State:
    """What the session API keeps between requests, on `app.state.rl_v1`."""

    retry_after_s: float = 1.0
    """`Retry-After` sent with a 429 when the store's own rule (staleness, memory) refuses."""
    admit: Admission | None = None
    """Back-pressure hook for whoever runs the trainer (None: only the store's rules apply)."""
    status_extra: Callable[[], dict[str, Any]] | None = None
    """More fields for `/rl/v1/status` (a trainer's step count, say)."""
    on_finalize: Callable[[Session], None] | None = None
    """Called once per session, after its first finalize (a consumer waiting for trajectories)."""
    finalized: OrderedDict[bytes, _Finalized] = field(default_factory=OrderedDict)
    """Key hash -> what the first finalize said, oldest first (bounded by RETIRED_KEYS)."""
    recent_rewards: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_REWARDS))
    refused: int = 0
    """Starts answered 429."""

    def remember(self, session: Session, final_reward: float | None) -> None:
        """Record a first finalize (bounded: the oldest entries go first)."""
        self.finalized[session.key_hash] = _Finalized(session.id, final_reward)
        while len(self.finalized) > RETIRED_KEYS:
            self.finalized.popitem(last=False)
        if final_reward is not None:
            self.recent_rewards.append(final_reward)

    def forget(self, session: Session) -> None:
        """The store forgot `session`: an aborted one's key no longer answers a late finalize.

        Only exported sessions stay remembered (their first finalize stands); keeping aborted
        ones would answer "exported" for them, and hold memory for every abandoned session.
        """
        if session.state == SessionState.ABORTED:
            self.finalized.pop(session.key_hash, None)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartSession(_Body):
    group_id: str | None = None
    task_id: str | None = None  # the other name of group_id
    metadata: dict[str, Any] | None = None
    api_key: str | None = None
    """A key of the caller's choosing (AReaL controllers pass one; 16-256 URL-safe characters,
    not the admin key, not another session's); random when absent."""


class SetReward(_Body):
    interaction_id: str | None = None
    completion_id: str | None = None  # the other name of interaction_id
    reward: float

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reward must be a finite number")
        return v


class ExportRequest(_Body):
    session_id: str
    discount: float = 1.0
    style: ExportStyle = DEFAULT_EXPORT_STYLE
    credit: CreditRule = DEFAULT_CREDIT_RULE
    ack: bool = False
    """Also acknowledge: the session is freed after this answer."""


class SessionRef(_Body):
    session_id: str


class FinalizeV1(_Body):
    final_reward: float | None = None
    reward: float | None = None
    role_rewards: dict[str, float] | None = None
    """Final rewards of single roles (the others get `final_reward`; docs/multi-agent.md)."""


class ChildSession(_Body):
    role: str


class AbortV1(_Body):
    reason: str | None = None


def state_of(app_or_request: Any) -> V1State:
    """The session API's state of an app (or of a request's app)."""
    app = getattr(app_or_request, "app", app_or_request)
    return app.state.rl_v1


def _deps(request: Request) -> GatewayDeps:
    return request.app.state.deps


async def grant_capacity(request: Request) -> dict[str, int]:
    """How many more episodes may start under the staleness rule."""
    deps = _deps(request)
    require_admin(deps, request)
    return {"capacity": _capacity(deps)}


def _capacity(deps: GatewayDeps) -> int:
    c = deps.config
    if c.max_staleness is None:  # an in-process controller enforces staleness itself
        return max(0, c.max_sessions - len(deps.store))
    return deps.store.grant_capacity(deps.policy_version, c.max_staleness, c.batch_size)


def _group(group_id: str | None, task_id: str | None) -> str | None:
    if group_id is not None and task_id is not None and group_id != task_id:
        raise InvalidRequest("group_id and task_id name the same thing; give one, or the same value")
    group = group_id if group_id is not None else task_id
    if group is not None and not 1 <= len(group) <= 256:
        raise InvalidRequest("group_id must be 1-256 characters")
    return group


def _too_busy(request: Request, message: str, retry_after_s: float) -> JSONResponse:
    state_of(request).refused += 1
    wait = max(1, math.ceil(retry_after_s))  # Retry-After is whole seconds (RFC 9110)
    body = wire_openai_chat.error_body(CapacityExhausted(f"{message}; retry in {wait} s"))
    return JSONResponse(body, status_code=429, headers={"retry-after": str(wait)})


async def start_session(request: Request) -> Any:
    """Open a session (GET: query parameters; POST: JSON body); 429 + Retry-After when the
    staleness rule, the store or the service's admission hook leaves no room."""
    deps = _deps(request)
    require_admin(deps, request)
    if request.method == "GET":
        q = request.query_params
        unknown = set(q) - {"group_id", "task_id"}
        if unknown:
            raise InvalidRequest(f"unknown query parameters: {', '.join(sorted(unknown))}")
        body = StartSession(group_id=q.get("group_id"), task_id=q.get("task_id"))
    else:
        body = await read_model(request, StartSession)
    group = _group(body.group_id, body.task_id)
    if body.api_key is not None:
        check_chosen_key(deps, body.api_key)
        if _key_hash(body.api_key) in state_of(request).finalized:
            # a finalized session's key stays its own: finalize answers for it by key
            raise InvalidRequest("api_key is already held by another session; choose another")
    state = state_of(request)
    if state.admit is not None:
        wait = state.admit(deps)
        if wait is not None:
            refusal = wait if isinstance(wait, Refusal) else Refusal(wait)
            return _too_busy(request, refusal.reason, refusal.retry_after_s)
    try:
        _capacity(deps)  # refreshes the staleness rule start_session enforces
        session = deps.store.start_session(task_id=group, metadata=body.metadata,
                                           api_key=body.api_key)
    except CapacityExhausted as e:
        return _too_busy(request, str(e), state.retry_after_s)
    assert session.api_key is not None  # a fresh session always has its plain key
    return {"session_id": session.id, "api_key": session.api_key, "group_id": group,
            "base_url": session_base_url(request, session.api_key)}


def session_base_url(request: Request, key: str) -> str:
    """The OpenAI-style base URL that reaches the session whose key is `key` by path."""
    return f"{str(request.base_url).rstrip('/')}/s/{key}/v1"


def _caller(request: Request) -> tuple[Session | None, bytes]:
    """The session the request's key (path first, then header) names, and the key's hash.

    None when the store no longer holds it (it may have been exported and forgotten).
    """
    key = request.path_params.get("session_key") or request_key(request)
    if not key:
        raise AuthenticationFailed(NO_SESSION)
    digest = _key_hash(key)
    try:
        return _deps(request).store.by_key(key), digest
    except AuthenticationFailed:
        return None, digest


def _known_session(request: Request) -> Session:
    session, _ = _caller(request)
    if session is None:
        raise AuthenticationFailed(NO_SESSION)
    return session


async def set_reward(request: Request) -> dict[str, Any]:
    """Reward one call of the caller's session (`interaction_id` or `completion_id`; the last
    call when neither)."""
    session = _known_session(request)
    body: SetReward = await read_model(request, SetReward)
    target = session.set_reward(interaction_id(body.interaction_id or body.completion_id),
                                body.reward)
    return {"session_id": session.id, "interaction_id": target, "reward": body.reward}


async def finalize(request: Request) -> dict[str, Any]:
    """End the trajectory with an optional final reward; a second finalize changes nothing."""
    session, digest = _caller(request)  # the key is checked before the body is read
    state = state_of(request)
    done = state.finalized.get(digest)
    if session is None and done is None:
        raise AuthenticationFailed(NO_SESSION)
    body: FinalizeV1 = await read_model(request, FinalizeV1)
    final = body.final_reward if body.final_reward is not None else body.reward
    if final is not None and not math.isfinite(final):
        raise InvalidRequest("final_reward must be a finite number")
    if done is not None:  # idempotent: the first finalize's reward stands
        current = str(session.state) if session is not None else str(SessionState.EXPORTED)
        return {"session_id": done.session_id, "state": current,
                "final_reward": done.final_reward, "already_finalized": True}
    if session is None:
        raise AuthenticationFailed(NO_SESSION)
    if session.state != SessionState.OPEN and session.state != SessionState.ENDED:
        raise SessionClosed(f"session {session.id} is {session.state}; it cannot be finalized")
    role_rewards = _role_rewards(body.role_rewards)
    if final is not None:
        session.set_final_reward(final)
    for role, value in role_rewards.items():
        session.set_final_reward(value, role=role)
    session.end()
    state.remember(session, session.final_reward)
    if state.on_finalize is not None:
        state.on_finalize(session)
    return {"session_id": session.id, "state": str(session.state),
            "final_reward": session.final_reward, "already_finalized": False}


def _role_rewards(given: dict[str, float] | None) -> dict[str, float]:
    """`finalize`'s per-role rewards, checked: role names, finite numbers."""
    out: dict[str, float] = {}
    for role, value in (given or {}).items():
        check_role(role, "a role in role_rewards")
        if not math.isfinite(value):
            raise InvalidRequest(f"role_rewards[{role!r}] must be a finite number")
        out[role] = float(value)
    return out


async def child_session(request: Request) -> dict[str, Any]:
    """A base URL for a sub-agent: its calls are recorded in the caller's session under `role`
    (one episode, one export), so the sub-agent needs only that URL (docs/multi-agent.md)."""
    deps = _deps(request)
    session = _known_session(request)
    body: ChildSession = await read_model(request, ChildSession)
    if not deps.config.roles:
        raise InvalidRequest("child sessions record a role per call: set gateway.roles: true")
    if not session.is_open:
        raise SessionClosed(f"session {session.id} is {session.state}; it takes no more calls")
    role = check_role(body.role, "role")
    key = request.path_params.get("session_key") or request_key(request)
    assert key is not None  # _known_session found the session by it
    root = str(request.base_url).rstrip("/")
    scoped = ROLE_PREFIX.format(session_key=key, role=role)
    return {"session_id": session.id, "role": role, "base_url": f"{root}{scoped}/v1"}


async def abort(request: Request) -> dict[str, Any]:
    """Abort the caller's session: it is never trained on (a failed episode, not reward 0)."""
    session, digest = _caller(request)  # the key is checked before the body is read
    if session is None and digest not in state_of(request).finalized:
        raise AuthenticationFailed(NO_SESSION)
    await read_model(request, AbortV1)
    if session is None:
        if digest in state_of(request).finalized:
            raise SessionClosed("session already exported; it can no longer be aborted")
        raise AuthenticationFailed(NO_SESSION)
    if session.state == SessionState.EXPORTED:
        raise SessionClosed(f"session {session.id} is already exported; it cannot be aborted")
    _deps(request).store.abort(session.id)
    return {"session_id": session.id, "state": str(session.state)}


async def status(request: Request) -> dict[str, Any]:
    """Service status: versions, sessions by state, recent final rewards."""
    deps = _deps(request)
    state = state_of(request)
    stats = deps.store.stats()
    rewards = list(state.recent_rewards)
    result: dict[str, Any] = {
        "status": "ok",
        "relayrl_version": relayrl.__version__,
        "model": deps.model_label,
        "policy_version": deps.policy_version,
        "uptime_s": round(time.time() - deps.started, 3),
        "sessions": {
            "open": stats.get(str(SessionState.OPEN), 0),
            "finished_waiting": stats.get(str(SessionState.ENDED), 0),
            "exported": stats.get(str(SessionState.EXPORTED), 0),
            "aborted": stats.get(str(SessionState.ABORTED), 0),
            "submitted": stats.get("submitted", 0),
            "refused": state.refused,
            # since start: closed sessions are forgotten, so the held counts above go back to 0
            "aborted_total": stats.get("aborted_total", 0),
            "expired_total": stats.get("expired_total", 0),
            "exported_total": stats.get("exported_total", 0),
        },
        "recent_reward": {"count": len(rewards),
                          "mean": sum(rewards) / len(rewards) if rewards else None},
    }
    if state.status_extra is not None:
        result.update(state.status_extra())
    return result


async def end_session(request: Request) -> dict[str, Any]:
    """Close the caller's session: later calls get 409."""
    deps = _deps(request)
    session = require_session(deps, request)
    session.end()
    return {"session_id": session.id, "state": str(session.state)}


async def export_trajectories(request: Request) -> dict[str, Any]:
    """Rows of one session with credit assigned; idempotent until acknowledged."""
    deps = _deps(request)
    require_admin(deps, request)
    body: ExportRequest = await read_model(request, ExportRequest)
    session = deps.store.get(body.session_id, touch=False)
    rows = export_session(session, style=body.style, credit=body.credit, discount=body.discount)
    result = {"session_id": session.id, "state": str(session.state), "style": body.style,
              "rows": [row_to_dict(r) for r in rows]}
    if body.ack:
        _acknowledge(deps, session.id)
    return result


async def abort_session(request: Request) -> dict[str, Any]:
    """Abort a session (a failed episode): never trained on, its capacity is given back."""
    deps = _deps(request)
    require_admin(deps, request)
    body: SessionRef = await read_model(request, SessionRef)
    session = deps.store.abort(body.session_id)
    return {"session_id": session.id, "state": str(session.state)}


async def ack_export(request: Request) -> dict[str, Any]:
    """Acknowledge an export: the session is freed."""
    deps = _deps(request)
    require_admin(deps, request)
    body: SessionRef = await read_model(request, SessionRef)
    _acknowledge(deps, body.session_id)
    return {"session_id": body.session_id, "state": "exported"}


class SetVersion(_Body):
    version: int


async def set_version(request: Request) -> dict[str, Any]:
    """An external trainer's word that the engine now serves `version` (admin); only forward."""
    deps = _deps(request)
    require_admin(deps, request)
    body: SetVersion = await read_model(request, SetVersion)
    if body.version < deps.policy_version:
        raise InvalidRequest(f"version {body.version} is behind the current version "
                             f"{deps.policy_version}; versions only move forward")
    deps.announced_version = body.version
    return {"version": deps.policy_version, "capacity": _capacity(deps)}


_LIST_LIMIT = 10_000


async def list_sessions(request: Request) -> dict[str, Any]:
    """Sessions in one state, oldest first (admin): `?state=ended` lists finalized ones."""
    deps = _deps(request)
    require_admin(deps, request)
    state = request.query_params.get("state", str(SessionState.ENDED))
    if state not in {str(s) for s in SessionState}:
        raise InvalidRequest(f"state must be one of {[str(s) for s in SessionState]}")
    raw_limit = request.query_params.get("limit", "1000")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= _LIST_LIMIT:
        raise InvalidRequest(f"limit must be an integer in [1, {_LIST_LIMIT}]")
    found = [s for s in deps.store if str(s.state) == state][: int(raw_limit)]
    return {"sessions": [{"session_id": s.id, "task_id": s.task_id, "group_id": s.task_id,
                          "state": str(s.state), "calls": len(s.interactions),
                          "metadata": dict(s.metadata)} for s in found]}


def _acknowledge(deps: GatewayDeps, session_id: str) -> None:
    deps.store.acknowledge(session_id)


async def health(request: Request) -> dict[str, Any]:
    """Liveness and a few counters."""
    deps = _deps(request)
    return {"status": "ok", "model": deps.model_label, "version": deps.engine.version,
            **deps.store.stats()}


@dataclass(frozen=True)
class Route:
    """One operation of the session API: its handler, methods and every path it answers on."""

    handler: Callable[[Request], Any]
    methods: tuple[str, ...]
    paths: tuple[str, ...]


def _keyed(path: str) -> tuple[str, str]:
    """`path`, and the same under a key-addressed session root."""
    return path, SESSION_PREFIX + path


ROUTES: tuple[Route, ...] = (
    Route(grant_capacity, ("POST",), ("/grant_capacity",)),
    Route(start_session, ("POST",), ("/rl/start_session",)),
    Route(start_session, ("GET", "POST"), ("/rl/v1/start_session",)),
    Route(set_reward, ("POST",), ("/rl/set_reward", *_keyed("/rl/v1/set_reward"))),
    Route(end_session, ("POST",), ("/rl/end_session", "/rl/v1/end_session")),
    Route(finalize, ("POST",), _keyed("/rl/v1/finalize")),
    Route(abort, ("POST",), _keyed("/rl/v1/abort")),
    Route(child_session, ("POST",), _keyed("/rl/v1/child_session")),
    Route(export_trajectories, ("POST",), ("/export_trajectories",)),
    Route(ack_export, ("POST",), ("/rl/ack_export",)),
    Route(abort_session, ("POST",), ("/rl/abort_session",)),
    Route(list_sessions, ("GET",), ("/rl/sessions",)),
    Route(set_version, ("POST",), ("/rl/v1/set_version",)),
    Route(status, ("GET",), ("/rl/v1/status",)),
    Route(health, ("GET",), ("/health",)),
)
"""The session API, each operation once, with the paths that are aliases of it."""


def register(app: FastAPI) -> None:
    """Add the session API's routes to `app` and give it a fresh `V1State`."""
    app.state.rl_v1 = state = V1State()
    deps: GatewayDeps | None = getattr(app.state, "deps", None)
    if deps is not None:
        deps.store.on_forget.append(state.forget)
    for route in ROUTES:
        for path in route.paths:
            app.add_api_route(path, route.handler, methods=list(route.methods))
