"""Serve a router with uvicorn: in the foreground (`serve`) or in a thread (`RouterThread`), as
the gateway is served (`relayrl.asgi`: the same loop, parser and header, body and keep-alive
timeouts).

May import: relayrl.router, relayrl.errors, relayrl.asgi, uvicorn. Nothing of the gateway's.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from relayrl.asgi import ServerThread, serve_until_stopped, server_config
from relayrl.router.app import Router
from relayrl.router.config import RouterConfig


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _config(router: Router, host: str, port: int) -> Any:
    # uvicorn runs the app's lifespan: the health checks and the backends' connection pool
    return server_config(router.app(), host, port)


def serve(config: RouterConfig) -> None:
    """Serve until interrupted, printing the address once listening."""
    router = Router(config)
    if not _loopback(config.host) and not config.tenants:
        # The router authenticates nothing itself without tenants: the gateways must.
        print("relayrl router: listening off loopback; every backend gateway must have "
              "--admin-key set", flush=True)

    def listening(url: str) -> None:
        healthy = sum(b.healthy for b in router.backends)
        print(f"relayrl router listening at {url} "
              f"({healthy}/{len(router.backends)} backends healthy)", flush=True)

    serve_until_stopped(_config(router, config.host, config.port), listening)


class RouterThread(ServerThread):
    """A router served on a loopback port in a background thread (tests, benchmarks,
    the replicas launcher). `with RouterThread(config) as r: r.url`."""

    def __init__(self, config: RouterConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.router = Router(config)
        super().__init__(_config(self.router, host, port), name="relayrl-router")
