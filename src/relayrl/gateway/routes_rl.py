"""RL routes: capacity, sessions, rewards, export (our spelling; seed 003's `/rl/v1/*` is in
routes_rl_v1).

Admin routes need the admin key; reward and end routes need the session's own key. Bodies are
validated by small pydantic models so a bad field is a 400/422 in OpenAI's error shape. Export
styles and credit rules are `relayrl.trajectory`'s enums, defaults included (one definition).

May import: FastAPI, pydantic, `relayrl.errors`, `relayrl.trajectory` and the gateway modules
below the app (`auth`, `bodies`, `core`, `wires`); never `gateway.app` (it registers these).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, field_validator

from relayrl.errors import InvalidRequest
from relayrl.gateway.auth import check_chosen_key, require_admin, require_session
from relayrl.gateway.bodies import read_model
from relayrl.gateway.core import GatewayDeps
from relayrl.gateway.wires import interaction_id
from relayrl.trajectory import (
    DEFAULT_CREDIT_RULE,
    DEFAULT_EXPORT_STYLE,
    CreditRule,
    ExportStyle,
    SessionState,
    export_session,
    row_to_dict,
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartSession(_Body):
    task_id: str | None = None
    metadata: dict[str, Any] | None = None
    api_key: str | None = None
    """A key of the caller's choosing (AReaL controllers pass one; 16-256 URL-safe characters,
    not the admin key, not another session's); random when absent."""


class SetReward(_Body):
    interaction_id: str | None = None
    completion_id: str | None = None  # seed 003's name for interaction_id
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


async def start_session(request: Request) -> dict[str, Any]:
    """Open a session; 429 when the staleness rule leaves no capacity."""
    deps = _deps(request)
    require_admin(deps, request)
    body: StartSession = await read_model(request, StartSession)
    if body.api_key is not None:
        check_chosen_key(deps, body.api_key)
    _capacity(deps)  # refreshes the staleness rule start_session enforces
    session = deps.store.start_session(task_id=body.task_id, metadata=body.metadata,
                                       api_key=body.api_key)
    assert session.api_key is not None  # a fresh session always has its plain key
    # the base URL carries the key, never the id: a session id names a session, opens nothing
    base = str(request.base_url).rstrip("/")
    return {"session_id": session.id, "api_key": session.api_key,
            "base_url": f"{base}/s/{session.api_key}/v1"}


async def set_reward(request: Request) -> dict[str, Any]:
    """Reward one call of the caller's session (the last one when no id is given)."""
    deps = _deps(request)
    session = require_session(deps, request)
    body: SetReward = await read_model(request, SetReward)
    iid = body.interaction_id or body.completion_id
    target = session.set_reward(interaction_id(iid), body.reward)
    return {"session_id": session.id, "interaction_id": target, "reward": body.reward}


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


def register(app: FastAPI) -> None:
    """Add the RL routes to `app`."""
    post = [
        ("/grant_capacity", grant_capacity),
        ("/rl/start_session", start_session),
        ("/rl/set_reward", set_reward),
        ("/rl/end_session", end_session),
        ("/rl/v1/end_session", end_session),
        ("/export_trajectories", export_trajectories),
        ("/rl/ack_export", ack_export),
        ("/rl/abort_session", abort_session),
        ("/rl/v1/set_version", set_version),
    ]
    app.add_api_route("/rl/sessions", list_sessions, methods=["GET"])
    for path, fn in post:
        app.add_api_route(path, fn, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
