"""Browser-facing guards in front of every route: the Host header and the body's content type.

A gateway on a loopback address is reachable from any web page the user opens: a page can POST
`text/plain` bodies without a CORS preflight (a "simple" request), and a DNS-rebinding page talks
to `127.0.0.1` under its own host name. So, as one pure ASGI middleware (cheap enough for the
completion routes):

- on a loopback bind, the `Host` header must name `localhost`, `127.0.0.1`, `[::1]` or the bound
  address itself, any port (else 403);
- a request that carries a body must declare a JSON content type (`application/json` or
  `application/*+json`, else 415).

Errors use the calling protocol's shape (Anthropic on `/messages` routes, OpenAI elsewhere).

May import: Starlette types, `relayrl.errors`, `relayrl.gateway.wires`.
"""

from __future__ import annotations

import ipaddress
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from relayrl.errors import InvalidRequest, RelayError
from relayrl.gateway.wires import ANTHROPIC, OPENAI_CHAT

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})
"""Host names a loopback-bound gateway answers to (any port)."""


class ForbiddenHost(RelayError):
    """The Host header names a host this loopback gateway does not serve (DNS rebinding)."""

    status_code = 403
    error_type = "permission_error"


class UnsupportedMediaType(InvalidRequest):
    """A request body that is not declared as JSON."""

    status_code = 415


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host part of a Host header value (`[::1]:8000` -> `[::1]`), lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[: end + 1] if end > 0 else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_json_type(content_type: str) -> bool:
    """Whether a Content-Type value declares JSON (`application/json`, `application/*+json`)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


class Guard:
    """ASGI middleware: Host check on loopback binds, JSON content type for request bodies."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.check(scope)
        if error is None:
            await self.app(scope, receive, send)
            return
        wire = ANTHROPIC if scope.get("path", "").rstrip("/").endswith("/messages") else OPENAI_CHAT
        body = json.dumps(wire.format.error_body(error)).encode()
        await send({"type": "http.response.start", "status": error.status_code,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def check(scope: Scope) -> RelayError | None:
        """The error this request gets before any route sees it, or None."""
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.lower(), v)
        server = scope.get("server")
        if server and _is_loopback(str(server[0])):
            raw = headers.get(b"host", b"").decode("latin-1")
            name = host_name(raw)
            if not (name in LOOPBACK_NAMES or name == str(server[0]).lower()):
                return ForbiddenHost("this gateway listens on loopback and answers only to "
                                     "localhost, 127.0.0.1 or [::1] in the Host header")
        has_body = (headers.get(b"content-length", b"0").strip() not in (b"", b"0")
                    or b"transfer-encoding" in headers)
        declared = headers.get(b"content-type")
        sends_body = scope.get("method") in ("POST", "PUT", "PATCH") and (
            declared is not None or has_body)
        if sends_body and not is_json_type((declared or b"").decode("latin-1")):
            return UnsupportedMediaType("request bodies must be JSON: send "
                                        "Content-Type: application/json")
        return None


__all__ = ["ForbiddenHost", "Guard", "UnsupportedMediaType", "host_name", "is_json_type"]
