"""`SessionClient`: the session lifecycle over HTTP (capacity, start, reward, end, export).

Used by workflows and tests to drive a gateway, local or remote. Errors come back as relayrl's own
error classes, mapped from the gateway's status codes in one table.

May import: httpx, `relayrl.errors`, `relayrl.trajectory` (style and credit names); never the
gateway's modules (it talks to any gateway over HTTP), openai or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from relayrl.client.pool import pooled_client
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


class SessionClient:
    """Drives sessions on a gateway at `gateway_url` (its root, e.g. `http://127.0.0.1:8000`)."""

    def __init__(self, gateway_url: str, admin_key: str | None = None,
                 http_client: httpx.AsyncClient | None = None, timeout_s: float = 60.0) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.admin_key = admin_key
        self._own_client = http_client is None
        # pooled connections expire before the gateway's keep-alive closes them: an abort or
        # export after an idle episode would otherwise race the server's close
        self.http = http_client or pooled_client(timeout_s)

    async def aclose(self) -> None:
        """Close the HTTP client if this object made it."""
        if self._own_client:
            await self.http.aclose()

    async def __aenter__(self) -> SessionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def openai_base_url(self) -> str:
        """Base URL for OpenAI clients that send the session key as their API key."""
        return f"{self.gateway_url}/v1"

    async def _post(self, path: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        resp = await self.http.post(f"{self.gateway_url}{path}", json=body, headers=headers)
        if resp.status_code >= 400:
            raise _error_from(resp)
        return resp.json()

    async def grant_capacity(self) -> int:
        """How many more episodes the gateway admits now."""
        return int((await self._post("/grant_capacity", {}, self.admin_key))["capacity"])

    async def start_session(self, task_id: str | None = None,
                            metadata: dict[str, Any] | None = None) -> SessionHandle:
        """Open a session (raises CapacityExhausted on 429)."""
        body: dict[str, Any] = {"task_id": task_id, "metadata": metadata}
        r = await self._post("/rl/start_session", body, self.admin_key)
        return SessionHandle(r["session_id"], r["api_key"], r["base_url"])

    async def set_reward(self, session: SessionHandle, reward: float,
                         interaction_id: str | None = None) -> str:
        """Reward one call (the last one when no id is given); returns the call's id."""
        body = {"reward": reward, "interaction_id": interaction_id}
        return (await self._post("/rl/set_reward", body, session.api_key))["interaction_id"]

    async def end_session(self, session: SessionHandle) -> None:
        """Close the session; it takes no more calls."""
        await self._post("/rl/end_session", {}, session.api_key)

    async def finalize(self, session: SessionHandle, final_reward: float | None = None) -> None:
        """Set a trajectory reward and end the session."""
        await self._post("/rl/v1/finalize", {"final_reward": final_reward}, session.api_key)

    async def export(self, session_id: str, style: str = DEFAULT_EXPORT_STYLE,
                     credit: str = DEFAULT_CREDIT_RULE, discount: float = 1.0,
                     ack: bool = False) -> list[dict[str, Any]]:
        """The session's rows (idempotent until acknowledged)."""
        body = {"session_id": session_id, "style": style, "credit": credit,
                "discount": discount, "ack": ack}
        return (await self._post("/export_trajectories", body, self.admin_key))["rows"]

    async def ack_export(self, session_id: str) -> None:
        """Acknowledge an export: the gateway frees the session."""
        await self._post("/rl/ack_export", {"session_id": session_id}, self.admin_key)


    async def abort_session(self, session_id: str) -> None:
        """Abort a session: never trained on, its capacity goes back (admin)."""
        await self._post("/rl/abort_session", {"session_id": session_id}, self.admin_key)

    async def list_sessions(self, state: str, limit: int = 1000) -> list[dict[str, Any]]:
        """Sessions in `state` (open, ended, exported, aborted), oldest first (admin)."""
        headers = {"authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        resp = await self.http.get(f"{self.gateway_url}/rl/sessions",
                                   params={"state": state, "limit": limit}, headers=headers)
        if resp.status_code >= 400:
            raise _error_from(resp)
        return list(resp.json()["sessions"])

    async def finished_sessions(self) -> list[dict[str, Any]]:
        """Finalized sessions waiting for export (admin)."""
        return await self.list_sessions("ended")

    async def open_sessions(self) -> list[str]:
        """Ids of sessions still taking calls (admin)."""
        return [s["session_id"] for s in await self.list_sessions("open")]


def _error_from(resp: httpx.Response) -> RelayError:
    try:
        err = resp.json().get("error", {})
        message = err.get("message") if isinstance(err, dict) else str(err)
    except ValueError:
        message = resp.text
    cls = _STATUS_ERRORS.get(resp.status_code, RelayError)
    return cls(f"gateway answered {resp.status_code}: {message}")
