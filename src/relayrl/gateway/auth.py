"""Who is calling: the admin, a session (by its key, in a header or in the path), or nobody.

The session key is the only secret that reaches a session: a session id names a session but
never opens it. Keys are compared in constant time (`hmac.compare_digest` on the admin key; the
store looks sessions up by the SHA-256 of their key and compares that digest in constant time).
A wrong or missing key is a 401 that says the same thing whether or not the session exists or
has ended, so the answer is no oracle for session ids or states.

With no admin key configured the control routes are off (an in-process gateway whose owner did
not ask for them); `relayrl gateway` always has one (`server.ensure_admin_key`). Callers with no
key at all then get unrecorded inference, which is what a person trying it by hand expects.

Key material is never logged or echoed: `redact_path` hides the key in a `/s/{key}/...` path
before any log line or error message names the path.

May import: FastAPI/Starlette request types, `relayrl.errors`, `relayrl.trajectory`,
`relayrl.gateway.core`.
"""

from __future__ import annotations

import hmac
import re

from fastapi import Request

from relayrl.errors import AuthenticationFailed, InvalidRequest
from relayrl.gateway.core import GatewayDeps
from relayrl.trajectory import Session

MIN_KEY_CHARS = 16
"""Shortest session key a caller may choose: 16 URL-safe characters (~95 bits if random)."""

MAX_KEY_CHARS = 256
"""Longest session key a caller may choose (it goes into the session's URL)."""

_URL_SAFE_KEY = re.compile(rf"[A-Za-z0-9_.~-]{{{MIN_KEY_CHARS},{MAX_KEY_CHARS}}}")
_KEYED_PATH = re.compile(r"^/s/[^/]*")

NO_SESSION = "invalid or missing session key"
"""The one message for every refused session key: it never says whether the session exists."""


def request_key(request: Request) -> str | None:
    """The key a request carries, from `Authorization: Bearer` or `x-api-key`."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


def is_admin(deps: GatewayDeps, key: str | None) -> bool:
    """Whether `key` is the admin key (always false when none is configured)."""
    admin = deps.config.admin_key
    return bool(admin and key and hmac.compare_digest(admin.encode(), key.encode()))


def require_admin(deps: GatewayDeps, request: Request) -> None:
    """Raise unless the request carries the admin key; with none configured, always raise."""
    if deps.config.admin_key is None:
        raise AuthenticationFailed(
            "control routes are off: this gateway was started without an admin key")
    if not is_admin(deps, request_key(request)):
        raise AuthenticationFailed("this route needs the admin key")


def session_by_key(deps: GatewayDeps, key: str | None) -> Session:
    """The session whose key is `key`; a 401 (one message for every reason) otherwise."""
    if not key:
        raise AuthenticationFailed(NO_SESSION)
    try:
        return deps.store.by_key(key)
    except AuthenticationFailed:
        raise AuthenticationFailed(NO_SESSION) from None


def require_session(deps: GatewayDeps, request: Request) -> Session:
    """The session whose key the request carries (path first, then headers); 401 otherwise."""
    key = request.path_params.get("session_key") or request_key(request)
    return session_by_key(deps, key)


def calling_session(deps: GatewayDeps, request: Request) -> Session | None:
    """The session a completion call belongs to, or None for unrecorded (admin/anonymous) use.

    A key in the path (`/s/{key}/...`) must name a live session. A header key is the admin key
    (unrecorded), else must name a session; only a gateway with no admin key serves callers that
    send no key, or a key that opens nothing, unrecorded.
    """
    path_key = request.path_params.get("session_key")
    if path_key is not None:
        return session_by_key(deps, path_key)
    key = request_key(request)
    if is_admin(deps, key):
        return None
    if deps.config.admin_key is None:
        if not key:
            return None
        try:
            return deps.store.by_key(key)
        except AuthenticationFailed:
            return None  # no admin key: anyone may use it unrecorded
    return session_by_key(deps, key)


def check_chosen_key(deps: GatewayDeps, key: str) -> None:
    """Refuse a session key a caller chose that is short, not URL-safe, or the admin key.

    A key already held by another session is refused by the store (`SessionStore.start_session`).
    The messages never repeat the key.
    """
    if not _URL_SAFE_KEY.fullmatch(key):
        raise InvalidRequest(f"api_key must be {MIN_KEY_CHARS}-{MAX_KEY_CHARS} URL-safe "
                             "characters (A-Z a-z 0-9 _ . ~ -)")
    if is_admin(deps, key):
        raise InvalidRequest("api_key must not be the admin key")


def redact_path(path: str) -> str:
    """`path` with the session key of a `/s/{key}/...` path replaced by `***`."""
    return _KEYED_PATH.sub("/s/***", path)


__all__ = ["MIN_KEY_CHARS", "calling_session", "check_chosen_key", "is_admin", "redact_path",
           "request_key", "require_admin", "require_session", "session_by_key"]
