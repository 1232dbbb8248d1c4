"""`SessionClient`: the session lifecycle over HTTP (capacity, start, reward, end, export).

Used by workflows and tests to drive a gateway, local or remote: each method runs one operation
of `relayrl.client.protocol` (which `AgentSession` runs too) on a pooled async client. Errors
come back as relayrl's own error classes (`protocol.error_from`).

May import: httpx, `relayrl.client.protocol`, `relayrl.client.pool`, `relayrl.trajectory`
(style and credit names); never the gateway's modules (it talks to any gateway over HTTP),
openai or torch.
"""

from __future__ import annotations

from typing import Any

import httpx

from relayrl.client import protocol
from relayrl.client.pool import pooled_client
from relayrl.client.protocol import SessionHandle
from relayrl.trajectory import DEFAULT_CREDIT_RULE, DEFAULT_EXPORT_STYLE


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

    async def _run(self, op: protocol.Operation[protocol.T]) -> protocol.T:
        return await protocol.run_async(op, self.http, self.gateway_url)

    async def grant_capacity(self) -> int:
        """How many more episodes the gateway admits now."""
        return await self._run(protocol.grant_capacity(self.admin_key))

    async def start_session(self, task_id: str | None = None,
                            metadata: dict[str, Any] | None = None) -> SessionHandle:
        """Open a session (raises CapacityExhausted on 429)."""
        handle, _ = await self._run(protocol.start_session(self.admin_key, task_id, metadata))
        return handle

    async def set_reward(self, session: SessionHandle, reward: float,
                         interaction_id: str | None = None) -> str:
        """Reward one call (the last one when no id is given); returns the call's id."""
        answer = await self._run(protocol.set_reward(session.api_key, reward, interaction_id))
        return str(answer["interaction_id"])

    async def end_session(self, session: SessionHandle) -> None:
        """Close the session; it takes no more calls."""
        await self._run(protocol.end_session(session.api_key))

    async def child_session(self, session: SessionHandle, role: str) -> SessionHandle:
        """A sub-agent's handle: its calls land in `session` under `role` (gateway.roles on)."""
        return await self._run(protocol.child_session(session.api_key, role))

    async def finalize(self, session: SessionHandle, final_reward: float | None = None,
                       role_rewards: dict[str, float] | None = None) -> None:
        """Set a trajectory reward and end the session."""
        await self._run(protocol.finalize(session.api_key, final_reward, role_rewards))

    async def export(self, session_id: str, style: str = DEFAULT_EXPORT_STYLE,
                     credit: str = DEFAULT_CREDIT_RULE, discount: float = 1.0,
                     ack: bool = False) -> list[dict[str, Any]]:
        """The session's rows (idempotent until acknowledged)."""
        return await self._run(protocol.export(self.admin_key, session_id, style, credit,
                                               discount, ack))

    async def ack_export(self, session_id: str) -> None:
        """Acknowledge an export: the gateway frees the session."""
        await self._run(protocol.ack_export(self.admin_key, session_id))

    async def abort_session(self, session_id: str) -> None:
        """Abort a session: never trained on, its capacity goes back (admin)."""
        await self._run(protocol.abort_session(self.admin_key, session_id))

    async def list_sessions(self, state: str, limit: int = 1000) -> list[dict[str, Any]]:
        """Sessions in `state` (open, ended, exported, aborted), oldest first (admin)."""
        return await self._run(protocol.list_sessions(self.admin_key, state, limit))

    async def finished_sessions(self) -> list[dict[str, Any]]:
        """Finalized sessions waiting for export (admin)."""
        return await self.list_sessions("ended")

    async def open_sessions(self) -> list[str]:
        """Ids of sessions still taking calls (admin)."""
        return [s["session_id"] for s in await self.list_sessions("open")]


__all__ = ["SessionClient", "SessionHandle"]
