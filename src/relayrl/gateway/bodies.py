"""Reading request bodies: size-limited JSON, and validation against a small pydantic model,
with every failure a 4xx in the calling protocol's error format (never a 500).

Shared by `gateway.app` (completion routes) and `gateway.routes_rl` (RL routes), so neither
imports the other. May import: FastAPI/Starlette request types, pydantic, `relayrl.errors`,
`relayrl.gateway.core`.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from relayrl.errors import InvalidRequest, PayloadTooLarge
from relayrl.gateway.core import GatewayDeps

B = TypeVar("B", bound=BaseModel)


async def read_json(request: Request) -> Any:
    """The request body as JSON, refusing oversized or malformed bodies with a 4xx."""
    deps: GatewayDeps = request.app.state.deps
    limit = deps.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    raw = await request.body()
    if len(raw) > limit:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {limit}")
    try:
        return json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None


async def read_model(request: Request, model: type[B]) -> B:
    """The request body validated as `model`; the first validation error becomes a 400."""
    data = await read_json(request)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise InvalidRequest(f"invalid {where}: {first.get('msg')}") from None


__all__ = ["read_json", "read_model"]
