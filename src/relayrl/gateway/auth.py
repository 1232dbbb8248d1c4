"""Who is calling: the admin, a session (by key or by path), or an anonymous caller.

Keys are compared in constant time (`hmac.compare_digest`); a session key reaches its own session
only. With no admin key configured (loopback only), callers without a session key get unrecorded
inference, which is what a person trying the gateway by hand expects.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from relayrl.errors import AuthenticationFailed
from relayrl.gateway.core import GatewayDeps
from relayrl.trajectory import Session


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
    """Raise unless the request carries the admin key, or no admin key is configured."""
    if deps.config.admin_key is None:
        return
    if not is_admin(deps, request_key(request)):
        raise AuthenticationFailed("this route needs the admin key")


def require_session(deps: GatewayDeps, request: Request) -> Session:
    """The session whose key the request carries; raise if it carries none that matches."""
    key = request_key(request)
    if not key:
        raise AuthenticationFailed("this route needs a session key (from /rl/start_session)")
    return deps.store.by_key(key)


def calling_session(deps: GatewayDeps, request: Request, session_id: str | None) -> Session | None:
    """The session a completion call belongs to, or None for unrecorded (admin/anonymous) use."""
    if session_id is not None:
        # The id in the path is the capability: it must name a live session.
        return deps.store.get(session_id)
    key = request_key(request)
    if (deps.config.admin_key is None and not key) or is_admin(deps, key):
        return None
    if not key:
        raise AuthenticationFailed("no key: send a session key from /rl/start_session")
    try:
        return deps.store.by_key(key)
    except AuthenticationFailed:
        if deps.config.admin_key is None:
            return None  # loopback without an admin key: anyone may use it unrecorded
        raise
