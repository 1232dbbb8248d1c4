"""`DirectClient`: a real `openai.AsyncOpenAI` wired to a gateway app in this process.

For agents that accept a client object (seed 000's "direct approach"): no network, no port, yet
every call goes through the same routes, renderer and session as over HTTP. The OpenAI client is
wrapped, not subclassed; attribute access (`.chat`, `.responses`, `.models`) is delegated to it.
Tradeoff: the ASGI transport buffers each response, so a streamed reply arrives all at once.
Closing the client frees its session on the gateway: acknowledged when its rows were exported
(the caller has them), aborted otherwise, so sessions never pile up in a long-lived app.

openai (and httpx2, the HTTP client it is built on and requires) are imported when a
`DirectClient` is made, so `import relayrl.client` works without the `agents` extra.

May import: httpx, `relayrl.client.session_client`, `relayrl.errors`, `relayrl.trajectory`;
openai/httpx2 only inside `DirectClient`. Never the gateway's modules (it is handed an app).
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx

from relayrl.client.session_client import SessionClient, SessionHandle
from relayrl.errors import RelayError, SessionClosed
from relayrl.trajectory import DEFAULT_CREDIT_RULE, DEFAULT_EXPORT_STYLE

_BASE = "http://relayrl.direct"


class DirectClient:
    """An OpenAI client bound to one session of an in-process gateway app."""

    def __init__(self, app: Any, session: SessionHandle, admin: SessionClient) -> None:
        # optional: the `agents` extra; openai's own client is httpx2, so the ASGI transport is too
        import httpx2
        from openai import AsyncOpenAI

        self.app = app
        self.session = session
        self._admin = admin
        self._http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url=_BASE,
                                       timeout=None)
        self.openai = AsyncOpenAI(base_url=f"{_BASE}/v1", api_key=session.api_key,
                                  http_client=self._http, max_retries=0)
        self._exported = False

    @classmethod
    async def open(cls, app: Any, task_id: str | None = None,
                   metadata: dict[str, Any] | None = None) -> DirectClient:
        """Start a session on `app` and return a client bound to it."""
        admin_key = app.state.deps.config.admin_key
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=_BASE)
        admin = SessionClient(_BASE, admin_key=admin_key, http_client=http)
        session = await admin.start_session(task_id=task_id, metadata=metadata)
        return cls(app, session, admin)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.openai, name)

    async def set_reward(self, interaction_id: str, reward: float) -> None:
        """Reward one call by its id (the `id` of the completion/response/message)."""
        await self._admin.set_reward(self.session, reward, interaction_id)

    async def set_last_reward(self, reward: float) -> None:
        """Reward the session's last call."""
        await self._admin.set_reward(self.session, reward)

    async def export_interactions(self, style: str = DEFAULT_EXPORT_STYLE, discount: float = 1.0,
                                  credit: str = DEFAULT_CREDIT_RULE) -> list[dict[str, Any]]:
        """End the session and return its rows (idempotent until acknowledged)."""
        with contextlib.suppress(SessionClosed):  # already ended is fine
            await self._admin.end_session(self.session)
        rows = await self._admin.export(self.session.session_id, style=style, credit=credit,
                                        discount=discount)
        self._exported = True
        return rows

    async def aclose(self) -> None:
        """Free the session (acknowledged if exported, else aborted); close the HTTP clients."""
        release = self._admin.ack_export if self._exported else self._admin.abort_session
        with contextlib.suppress(RelayError):  # already freed (or expired): nothing to do
            await release(self.session.session_id)
        await self.openai.close()
        await self._admin.http.aclose()

    async def __aenter__(self) -> DirectClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
