"""Seed 003's `/rl/v1/*` session protocol, key-addressed session URLs, and `/rl/v1/status`.

The any-agent service's wire protocol: `start_session` (GET or POST, with back-pressure as 429 +
`Retry-After`), `set_reward`, an idempotent `finalize`, an `abort` reachable with the session's own
key, and a status page. Sessions are also addressable by URL: `/s/{session_key}/v1/...` serves
the three completion APIs inside the session whose key is in the path, so an agent given only a
base URL (another process, another language) still lands in its session.

Imports: fastapi/starlette, pydantic, relayrl.errors, relayrl.trajectory and the gateway's own
modules (app, auth, core, routes_rl). Nothing above the gateway layer.
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

import relayrl
from relayrl.chat import wire_openai_chat
from relayrl.errors import AuthenticationFailed, CapacityExhausted, InvalidRequest, SessionClosed
from relayrl.gateway.auth import NO_SESSION, check_chosen_key, request_key, require_admin
from relayrl.gateway.bodies import read_model
from relayrl.gateway.core import GatewayDeps
from relayrl.gateway.routes_rl import SetReward, _Body, _capacity
from relayrl.gateway.wires import interaction_id as _interaction_id
from relayrl.trajectory import Session, SessionState
from relayrl.trajectory.session import hash_key as _key_hash

SESSION_PREFIX = "/s/{session_key}"
"""Key-addressed session root: `{root}/s/{key}/v1` is an OpenAI-style base URL of the session."""

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
    """What the v1 routes keep between requests, on `app.state.rl_v1`."""

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


class StartSessionV1(_Body):
    group_id: str | None = None
    task_id: str | None = None  # the older name of group_id
    metadata: dict[str, Any] | None = None
    api_key: str | None = None
    """A session key of the caller's choosing (URL-safe, 16-256 characters); random when absent."""


class FinalizeV1(_Body):
    final_reward: float | None = None
    reward: float | None = None


class AbortV1(_Body):
    reason: str | None = None


def state_of(app_or_request: Any) -> V1State:
    """The v1 routes' state of an app (or of a request's app)."""
    app = getattr(app_or_request, "app", app_or_request)
    return app.state.rl_v1


def _deps(request: Request) -> GatewayDeps:
    return request.app.state.deps


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
    """Open a session (GET: query parameters; POST: JSON body); 429 + Retry-After when full."""
    deps = _deps(request)
    require_admin(deps, request)
    if request.method == "GET":
        q = request.query_params
        unknown = set(q) - {"group_id", "task_id"}
        if unknown:
            raise InvalidRequest(f"unknown query parameters: {', '.join(sorted(unknown))}")
        body = StartSessionV1(group_id=q.get("group_id"), task_id=q.get("task_id"))
    else:
        body = await read_model(request, StartSessionV1)
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
    """Reward one call (`completion_id` or `interaction_id`; the last call when neither)."""
    session = _known_session(request)
    body: SetReward = await read_model(request, SetReward)
    target = session.set_reward(_interaction_id(body.interaction_id or body.completion_id),
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
    if final is not None:
        session.set_final_reward(final)
    session.end()
    state.remember(session, session.final_reward)
    if state.on_finalize is not None:
        state.on_finalize(session)
    return {"session_id": session.id, "state": str(session.state),
            "final_reward": session.final_reward, "already_finalized": False}


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


async def keyed_count_tokens(request: Request) -> Any:
    """Anthropic `count_tokens` under a key-addressed base URL (Claude Code calls it)."""
    from relayrl.gateway import app as gateway_app

    return await gateway_app.count_tokens(request)  # the path's key decides


def _keyed(handler_name: str) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Any:
        from relayrl.gateway import app as gateway_app

        wire = {"chat": gateway_app.OPENAI_CHAT, "responses": gateway_app.OPENAI_RESPONSES,
                "messages": gateway_app.ANTHROPIC}[handler_name]
        return await gateway_app.answer_completion(request, wire)  # the path's key decides

    endpoint.__name__ = f"keyed_{handler_name}"
    return endpoint


async def keyed_models(request: Request) -> Any:
    """`/s/{key}/v1/models`: the policy being served."""
    from relayrl.gateway.app import list_models

    _known_session(request)
    return JSONResponse(await list_models(request))


def register(app: FastAPI) -> None:
    """Add the v1 routes to `app` and give it a fresh `V1State`."""
    app.state.rl_v1 = state = V1State()
    deps: GatewayDeps | None = getattr(app.state, "deps", None)
    if deps is not None:
        deps.store.on_forget.append(state.forget)
    app.add_api_route("/rl/v1/start_session", start_session, methods=["GET", "POST"])
    app.add_api_route("/rl/v1/status", status, methods=["GET"])
    for prefix in ("", SESSION_PREFIX):
        app.add_api_route(prefix + "/rl/v1/set_reward", set_reward, methods=["POST"])
        app.add_api_route(prefix + "/rl/v1/finalize", finalize, methods=["POST"])
        app.add_api_route(prefix + "/rl/v1/abort", abort, methods=["POST"])
    for path in ("/v1/chat/completions", "/chat/completions"):
        app.add_route(SESSION_PREFIX + path, _keyed("chat"), methods=["POST"])
    for path in ("/v1/responses", "/responses"):
        app.add_route(SESSION_PREFIX + path, _keyed("responses"), methods=["POST"])
    app.add_route(SESSION_PREFIX + "/v1/messages", _keyed("messages"), methods=["POST"])
    app.add_route(SESSION_PREFIX + "/v1/models", keyed_models, methods=["GET"])
    app.add_route(SESSION_PREFIX + "/v1/messages/count_tokens", keyed_count_tokens,
                  methods=["POST"])
