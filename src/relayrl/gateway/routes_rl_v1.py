"""Key-addressed session URLs: `/s/{session_key}/v1/...` serves the three completion APIs,
`/v1/models` and `count_tokens` inside the session whose key is in the path, so an agent given
only a base URL (another process, another language) still lands in its session. The session
API itself (`/rl/*`, `/rl/v1/*`, and its `/s/{key}/rl/v1/*` aliases) is `routes_rl`.

May import: fastapi/starlette, relayrl.errors and the gateway's own modules (app, routes_rl).
Nothing above the gateway layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from relayrl.gateway.routes_rl import (  # the session API's state, for those that install hooks
    ROLE_PREFIX,
    SESSION_PREFIX,
    Admission,
    Refusal,
    V1State,
    _known_session,
    state_of,
)


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
    """Add the key-addressed completion routes to `app` (plain and role-scoped)."""
    for prefix in (SESSION_PREFIX, ROLE_PREFIX):
        for path in ("/v1/chat/completions", "/chat/completions"):
            app.add_route(prefix + path, _keyed("chat"), methods=["POST"])
        for path in ("/v1/responses", "/responses"):
            app.add_route(prefix + path, _keyed("responses"), methods=["POST"])
        app.add_route(prefix + "/v1/messages", _keyed("messages"), methods=["POST"])
        app.add_route(prefix + "/v1/models", keyed_models, methods=["GET"])
        app.add_route(prefix + "/v1/messages/count_tokens", keyed_count_tokens,
                      methods=["POST"])


__all__ = ["ROLE_PREFIX", "SESSION_PREFIX", "Admission", "Refusal", "V1State", "keyed_count_tokens",
           "keyed_models", "register", "state_of"]
