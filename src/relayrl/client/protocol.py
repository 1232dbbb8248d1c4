"""The session protocol, written once: each operation as the HTTP requests it sends and the
reading of their answers, with no I/O of its own.

An operation is a generator: it yields a `Call` (and gets the `httpx.Response` back) or a `Wait`
(a pause before trying again), and returns its result. `run_async` drives one on an
`httpx.AsyncClient`, `run_sync` on an `httpx.Client`; `SessionClient` (a training run's
controller) and `AgentSession` (an agent's `with` block, sync or async) are both façades over
these operations. Errors come back as relayrl's own error classes, mapped from the gateway's
status codes in one table.

May import: httpx, `relayrl.errors`, `relayrl.trajectory` (style and credit names); never the
gateway's modules (it talks to any gateway over HTTP), openai or torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from relayrl.errors import (
    AuthenticationFailed,
    CapacityExhausted,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RelayError,
    SessionClosed,
)
from relayrl.trajectory import DEFAULT_CREDIT_RULE, DEFAULT_EXPORT_STYLE

log = logging.getLogger(__name__)

T = TypeVar("T")

_STATUS_ERRORS: dict[int, type[RelayError]] = {
    400: InvalidRequest, 401: AuthenticationFailed, 404: NotFound, 409: SessionClosed,
    413: PayloadTooLarge, 422: InvalidRequest, 429: CapacityExhausted,
}


@dataclass(frozen=True)
class SessionHandle:
    """What an agent needs to talk inside one session."""

    session_id: str
    api_key: str
    base_url: str
    """OpenAI-style base URL bound to the session by its key in the path (`.../s/{key}/v1`):
    a secret, like `api_key`."""


@dataclass(frozen=True)
class Call:
    """One request of an operation: sent with `key` as a bearer token (when given)."""

    method: str
    path: str
    key: str | None
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None


@dataclass(frozen=True)
class Wait:
    """A pause an operation asks for before its next call."""

    seconds: float


Operation = Generator[Call | Wait, httpx.Response | None, T]
"""A protocol operation: yields calls and waits, returns its result."""


def _send(call: Call) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {call.key}"} if call.key else {}
    return {"json": call.json, "params": call.params, "headers": headers}


async def run_async(op: Operation[T], http: httpx.AsyncClient, root: str) -> T:
    """Run `op` against the gateway at `root` on an async client."""
    reply: httpx.Response | None = None
    while True:  # ends when the operation returns (each operation's own loops are bounded)
        try:
            step = op.send(reply)
        except StopIteration as done:
            return done.value
        if isinstance(step, Wait):
            await asyncio.sleep(step.seconds)
            reply = None
        else:
            reply = await http.request(step.method, root + step.path, **_send(step))


def run_sync(op: Operation[T], http: httpx.Client, root: str) -> T:
    """Run `op` against the gateway at `root` on a blocking client."""
    reply: httpx.Response | None = None
    while True:  # ends when the operation returns (each operation's own loops are bounded)
        try:
            step = op.send(reply)
        except StopIteration as done:
            return done.value
        if isinstance(step, Wait):
            time.sleep(step.seconds)
            reply = None
        else:
            reply = http.request(step.method, root + step.path, **_send(step))


def error_from(resp: httpx.Response) -> RelayError:
    """The relayrl error a gateway's error answer stands for."""
    cls = _STATUS_ERRORS.get(resp.status_code, RelayError)
    return cls(f"gateway answered {resp.status_code}: {error_message(resp)}")


def error_message(resp: httpx.Response) -> str:
    """The message of a gateway's error answer (its text when it is not JSON)."""
    try:
        err = resp.json().get("error", {})
        return str(err.get("message")) if isinstance(err, dict) else str(err)
    except ValueError:
        return resp.text[:200]


def _answer(resp: httpx.Response | None) -> dict[str, Any]:
    assert resp is not None  # a Call is always answered
    if resp.status_code >= 400:
        raise error_from(resp)
    return resp.json()


# ---- the operations ----------------------------------------------------------------------------


def grant_capacity(admin_key: str | None) -> Operation[int]:
    """How many more episodes the gateway admits now."""
    return int(_answer((yield Call("POST", "/grant_capacity", admin_key, {})))["capacity"])


def _retry_after(resp: httpx.Response) -> float:
    try:
        wait = float(resp.headers.get("retry-after", "1"))
    except ValueError:  # an HTTP date: not worth parsing, the service sends seconds
        wait = 1.0
    return min(max(wait, 0.05), 3600.0)  # never a busy loop, never a day


def start_session(admin_key: str | None, group_id: str | None = None,
                  metadata: dict[str, Any] | None = None,
                  wait_s: float | None = None) -> Operation[tuple[SessionHandle, int]]:
    """Open a session; the handle and how many 429s were waited out. With `wait_s`, a 429 is
    waited out (its `Retry-After`) for up to that long; without, it raises CapacityExhausted."""
    body = {"group_id": group_id, "metadata": metadata}
    deadline = time.monotonic() + (wait_s or 0.0)
    waits = 0
    for _ in range(1 << 20):  # bounded by the deadline below, not by this count
        resp = yield Call("POST", "/rl/v1/start_session", admin_key, body)
        assert resp is not None
        if resp.status_code != 429 or wait_s is None:
            break
        wait = _retry_after(resp)
        if time.monotonic() + wait > deadline:
            raise CapacityExhausted(
                f"the service refused new sessions for longer than {wait_s} s "
                f"({waits} waits): {error_message(resp)}")
        waits += 1
        log.info("service busy (429); starting the session again in %.1f s", wait)
        yield Wait(wait)
    data = _answer(resp)
    return SessionHandle(data["session_id"], data["api_key"], data["base_url"]), waits


def set_reward(session_key: str, reward: float,
               interaction_id: str | None = None) -> Operation[dict[str, Any]]:
    """Reward one call of the session (the last one when no id is given)."""
    body = {"interaction_id": interaction_id, "reward": reward}
    return _answer((yield Call("POST", "/rl/v1/set_reward", session_key, body)))


def end_session(session_key: str) -> Operation[dict[str, Any]]:
    """Close the session; it takes no more calls."""
    return _answer((yield Call("POST", "/rl/v1/end_session", session_key, {})))


def finalize(session_key: str, final_reward: float | None,
             role_rewards: dict[str, float] | None = None) -> Operation[dict[str, Any]]:
    """Set the trajectory's reward (and, optionally, single roles' rewards) and end the session
    (a second finalize changes nothing)."""
    body: dict[str, Any] = {"final_reward": final_reward}
    if role_rewards:
        body["role_rewards"] = dict(role_rewards)
    return _answer((yield Call("POST", "/rl/v1/finalize", session_key, body)))


def child_session(session_key: str, role: str) -> Operation[SessionHandle]:
    """A handle whose base URL records calls in the same session under `role` (a sub-agent)."""
    data = _answer((yield Call("POST", "/rl/v1/child_session", session_key, {"role": role})))
    return SessionHandle(data["session_id"], session_key, data["base_url"])


def abort(session_key: str, reason: str) -> Operation[dict[str, Any]]:
    """Abort the session with its own key: it is never trained on."""
    return _answer((yield Call("POST", "/rl/v1/abort", session_key, {"reason": reason})))


def abort_session(admin_key: str | None, session_id: str) -> Operation[dict[str, Any]]:
    """Abort a session by id (admin): never trained on, its capacity goes back."""
    body = {"session_id": session_id}
    return _answer((yield Call("POST", "/rl/abort_session", admin_key, body)))


def export(admin_key: str | None, session_id: str, style: str = DEFAULT_EXPORT_STYLE,
           credit: str = DEFAULT_CREDIT_RULE, discount: float = 1.0,
           ack: bool = False) -> Operation[list[dict[str, Any]]]:
    """The session's rows (idempotent until acknowledged)."""
    body = {"session_id": session_id, "style": style, "credit": credit, "discount": discount,
            "ack": ack}
    return list(_answer((yield Call("POST", "/export_trajectories", admin_key, body)))["rows"])


def ack_export(admin_key: str | None, session_id: str) -> Operation[dict[str, Any]]:
    """Acknowledge an export: the gateway frees the session."""
    body = {"session_id": session_id}
    return _answer((yield Call("POST", "/rl/ack_export", admin_key, body)))


def list_sessions(admin_key: str | None, state: str,
                  limit: int = 1000) -> Operation[list[dict[str, Any]]]:
    """Sessions in `state` (open, ended, exported, aborted), oldest first (admin)."""
    params = {"state": state, "limit": limit}
    answer = _answer((yield Call("GET", "/rl/sessions", admin_key, params=params)))
    return list(answer["sessions"])
