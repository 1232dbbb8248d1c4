"""The rollout server's FastAPI app: `GET /tools`, `POST /rollout`, `GET /health`.

A malformed `/rollout` body is a 422 (FastAPI's validation answer); a rollout that fails once
started is a 200 with `status: ERROR` and a readable `error_message`, so the trainer can tell
"the request was wrong" from "the episode failed". With an API key configured, `/rollout` and
`/tools` need it (`Authorization: Bearer KEY` or `x-api-key`, compared in constant time): a 401
otherwise. A request naming a callback host or a tokenizer the server was not configured for
is a 403. Refusals carry the protocol's error body (`status: ERROR`, `error_message`,
`final_messages: []`). May import this package, fastapi and httpx.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from relayrl.remote_rollout.config import ServerConfig
from relayrl.remote_rollout.executor import AppState, execute_rollout
from relayrl.remote_rollout.schemas import (
    RolloutRequest,
    RolloutResponse,
    RolloutStatus,
    ToolsResponse,
)

log = logging.getLogger("relayrl.remote_rollout")

GUARDED_PATHS = ("/rollout", "/tools")
"""Routes that need the API key when one is configured (`/health` shows counts only)."""


def refusal(status_code: int, rollout_id: str, message: str) -> JSONResponse:
    """A refused request, answered in the protocol's error shape."""
    body = RolloutResponse(rollout_id=rollout_id, status=RolloutStatus.ERROR,
                           finish_reason="error", error_message=message)
    headers = {"www-authenticate": "Bearer"} if status_code == 401 else None
    return JSONResponse(body.model_dump(mode="json"), status_code=status_code, headers=headers)


def presented_key(request: Request) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY`, else `x-api-key`."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def key_matches(expected: str, presented: str | None) -> bool:
    """Whether `presented` is `expected`, in time independent of where they differ."""
    return presented is not None and hmac.compare_digest(expected.encode(), presented.encode())


def create_app(state: AppState | None = None, config: ServerConfig | None = None) -> FastAPI:
    """The app around `state` (built from `config`, else the environment, when not given)."""
    st = state or AppState.create(config or ServerConfig.from_env())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await st.aclose()

    app = FastAPI(title="relayrl rollout server", lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.rollout = st

    @app.middleware("http")
    async def require_key(request: Request,
                          call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        key = st.config.api_key
        if key is not None and request.url.path.rstrip("/") in GUARDED_PATHS:
            presented = presented_key(request)
            if not key_matches(key, presented):
                why = "no API key was sent" if presented is None else "the API key is wrong"
                return refusal(401, "", f"unauthorized: {why} (send Authorization: Bearer KEY)")
        return await call_next(request)

    @app.get("/tools", response_model=ToolsResponse)
    async def tools() -> ToolsResponse:
        """The tools this server's agent uses (a trainer worker reads them once)."""
        return ToolsResponse(tools=st.toolbox.definitions())

    @app.post("/rollout", response_model=RolloutResponse, response_model_exclude_none=False,
              responses={401: {"model": RolloutResponse}, 403: {"model": RolloutResponse}})
    async def rollout(body: RolloutRequest) -> Any:
        """Run one rollout, calling the trainer back for every LLM turn."""
        why = (st.config.callback_refusal(body.server_url)
               or st.config.tokenizer_refusal(body.tokenizer_name))
        if why is not None:
            log.warning("rollout %s refused: %s", body.rollout_id, why)
            return refusal(403, body.rollout_id, why)
        return await execute_rollout(st, body)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        """Liveness and counters."""
        return {"status": "ok", "active_rollouts": st.active, "peak_active_rollouts":
                st.peak_active, "max_concurrent_rollouts": st.config.max_concurrent_rollouts,
                "completed": st.completed, "errors": st.errors,
                "tokenizers_cached": st.tokenizers.names()}

    return app


__all__ = ["GUARDED_PATHS", "create_app", "key_matches", "presented_key", "refusal"]
