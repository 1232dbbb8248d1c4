"""The pooled HTTP client that rollouts (and a `SessionClient` with no client of its own) use,
with keep-alive that ends before the server's does.

Why: uvicorn (so the gateway, `keep_alive_timeout_s`, 5 s by default) closes a connection that
sat idle for 5 s, and httpx's own default is to keep one for 5 s too. A pooled connection reused
just as the server closes it fails the request ("Connection error": one episode in some main-job
runs, after an update left the pool idle). Expiring pooled connections sooner on the client side
closes that window; a fresh connection on loopback costs ~0.1 ms.
"""

from __future__ import annotations

import httpx

KEEPALIVE_EXPIRY_S = 2.0
"""Idle seconds after which the client drops a pooled connection: under the gateway's 5 s."""


def pooled_client(timeout_s: float, max_keepalive: int | None = 64) -> httpx.AsyncClient:
    """An httpx client for many concurrent calls: no connection cap, short-lived idle connections."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=max_keepalive,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        ),
    )
