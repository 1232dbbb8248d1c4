"""The rollout server's FastAPI app: `GET /tools`, `POST /rollout`, `GET /health`.

A malformed `/rollout` body is a 422 (FastAPI's validation answer); a rollout that fails once
started is a 200 with `status: ERROR` and a readable `error_message`, so the trainer can tell
"the request was wrong" from "the episode failed". May import this package, fastapi and httpx.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request

from relayrl.remote_rollout.config import ServerConfig
from relayrl.remote_rollout.executor import AppState, execute_rollout
from relayrl.remote_rollout.schemas import RolloutRequest, RolloutResponse, ToolsResponse


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

    @app.get("/tools", response_model=ToolsResponse)
    async def tools() -> ToolsResponse:
        """The tools this server's agent uses (a trainer worker reads them once)."""
        return ToolsResponse(tools=st.toolbox.definitions())

    @app.post("/rollout", response_model=RolloutResponse, response_model_exclude_none=False)
    async def rollout(body: RolloutRequest) -> RolloutResponse:
        """Run one rollout, calling the trainer back for every LLM turn."""
        return await execute_rollout(st, body)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        """Liveness and counters."""
        return {"status": "ok", "active_rollouts": st.active, "peak_active_rollouts":
                st.peak_active, "max_concurrent_rollouts": st.config.max_concurrent_rollouts,
                "completed": st.completed, "errors": st.errors,
                "tokenizers_cached": st.tokenizers.names()}

    return app


__all__ = ["create_app"]
