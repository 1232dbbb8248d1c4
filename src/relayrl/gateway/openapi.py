"""The gateway's OpenAPI document, served at `/openapi.json`, every route in it.

The completion routes are plain Starlette endpoints (FastAPI's per-request dependency solving
costs more than the rest of a short call) and the RL routes read their bodies themselves, so
FastAPI's generator sees neither their bodies nor their path parameters. This module adds them:
the wire routes with the wire formats' pydantic request schemas, the RL routes with their body
models and query parameters, `{session_key}` path parameters, and the two ways to send a key. A
user can read the API, and a schema fuzzer reaches every route.

May import: FastAPI's OpenAPI helpers, pydantic, `relayrl.chat.schema`, and the gateway's route
modules (for their body models); never `gateway.app`.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import relayrl
from relayrl.chat.schema.anthropic_messages import MessagesRequest
from relayrl.chat.schema.openai_chat import ChatCompletionRequest
from relayrl.chat.schema.openai_responses import ResponsesRequest
from relayrl.gateway.routes_rl import (
    ROLE_PREFIX,
    SESSION_PREFIX,
    AbortV1,
    ChildSession,
    ExportRequest,
    FinalizeV1,
    SessionRef,
    SetReward,
    StartSession,
)

_REF = "#/components/schemas/{model}"

WIRE_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": MessagesRequest,
}
"""Completion routes (also under `/s/{session_key}`) and the schema of their request bodies."""

RL_BODIES: dict[str, type[BaseModel]] = {
    "/rl/start_session": StartSession,
    "/rl/set_reward": SetReward,
    "/export_trajectories": ExportRequest,
    "/rl/ack_export": SessionRef,
    "/rl/abort_session": SessionRef,
    "/rl/v1/start_session": StartSession,
    "/rl/v1/set_reward": SetReward,
    "/rl/v1/finalize": FinalizeV1,
    "/rl/v1/abort": AbortV1,
    "/rl/v1/child_session": ChildSession,
}
"""POST routes whose handlers read a JSON body themselves, and its model."""

QUERY_PARAMS: dict[tuple[str, str], list[str]] = {
    ("/rl/v1/start_session", "get"): ["group_id", "task_id"],
    ("/rl/sessions", "get"): ["state", "limit"],
}

_PATH_PARAM = re.compile(r"{([^}]+)}")


def _schemas() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each body model's `$ref`, and the component schemas they need."""
    models = sorted({*WIRE_BODIES.values(), *RL_BODIES.values()}, key=lambda m: m.__name__)
    refs, doc = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    by_model = {m.__name__: refs[(m, "validation")] for m in models}
    return by_model, doc.get("$defs", {})


def _body(ref: dict[str, Any], required: bool) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": ref}}}


_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key", "in": "header", "required": False,
    "description": "a retry with the same key (same session, same body) gets the recorded answer",
    "schema": {"type": "string", "minLength": 1, "maxLength": 255},
}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document of `app`, completed with what FastAPI cannot see."""
    with warnings.catch_warnings():  # one endpoint serving GET and POST: ids are redone below
        warnings.simplefilter("ignore", UserWarning)
        doc = get_openapi(title="relayrl gateway", version=relayrl.__version__,
                          routes=app.routes,
                          description="OpenAI Chat Completions / Responses and Anthropic "
                                      "Messages from the policy being trained, recorded per "
                                      "session; and the RL routes that start, reward, end and "
                                      "export sessions.")
    refs, defs = _schemas()
    components = doc.setdefault("components", {})
    components.setdefault("schemas", {}).update(defs)
    components["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer",
                   "description": "the admin key or a session key"},
        "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    doc["security"] = [{"bearer": []}, {"x-api-key": []}, {}]
    paths: dict[str, dict[str, Any]] = doc.setdefault("paths", {})
    for prefix in ("", SESSION_PREFIX, ROLE_PREFIX):
        how = {"": "by header key", SESSION_PREFIX: "session by path key",
               ROLE_PREFIX: "session by path key, recorded under the path's role"}[prefix]
        for path, model in WIRE_BODIES.items():
            paths.setdefault(prefix + path, {})["post"] = {
                "summary": f"{model.__name__} ({how})",
                "operationId": f"{'keyed_' if prefix else ''}{path.strip('/').replace('/', '_')}",
                "requestBody": _body(refs[model.__name__], True),
                "responses": {"200": {"description": "the reply (JSON, or SSE when streaming)"}},
            }
            if not path.endswith("/count_tokens"):  # it generates nothing: nothing to retry
                paths[prefix + path]["post"]["parameters"] = [_IDEMPOTENCY_KEY]
    for prefix in (SESSION_PREFIX, ROLE_PREFIX):
        paths.setdefault(prefix + "/v1/models", {})["get"] = {
            "summary": "the policy being served (session by path key)",
            "operationId": "keyed_models", "responses": {"200": {"description": "OpenAI list shape"}}}
    for path, item in paths.items():
        for method, op in item.items():
            bare = path.removeprefix(SESSION_PREFIX)
            rl_body = RL_BODIES.get(bare)
            if method == "post" and rl_body is not None and "requestBody" not in op:
                op["requestBody"] = _body(refs[rl_body.__name__], False)
            params = op.setdefault("parameters", [])
            have = {(p.get("in"), p.get("name")) for p in params}
            for name in _PATH_PARAM.findall(path):
                if ("path", name) not in have:
                    params.append({"name": name, "in": "path", "required": True,
                                   "schema": {"type": "string"}})
            for name in QUERY_PARAMS.get((bare, method), []):
                if ("query", name) not in have:
                    params.append({"name": name, "in": "query", "required": False,
                                   "schema": {"type": "string"}})
            if not params:
                del op["parameters"]
            op["operationId"] = f"{method}_{re.sub(r'[^A-Za-z0-9]+', '_', path).strip('_')}"
    return doc


def install(app: FastAPI) -> None:
    """Serve `build_openapi(app)` as the app's OpenAPI document (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    # FastAPI's documented way to serve a custom document: replace the app's method
    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["RL_BODIES", "WIRE_BODIES", "build_openapi", "install"]
