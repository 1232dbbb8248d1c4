"""Serve a router: in the foreground (`serve`) or in a thread (`RouterThread`), on the router's
own HTTP/1.1 server (`relayrl.router.http`), or on uvicorn with `RELAYRL_ROUTER_HTTP=uvicorn`.

May import: relayrl.router, relayrl.errors, relayrl.asgi, uvicorn. Nothing of the gateway's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import threading
import time
from typing import Any

from relayrl.asgi import run as run_server
from relayrl.asgi import uvicorn_options
from relayrl.router.app import Router
from relayrl.router.config import RouterConfig
from relayrl.router.http import RouterHttpServer


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _server(router: Router, host: str, port: int) -> Any:  # RouterHttpServer or uvicorn.Server
    app = router.app()
    if os.environ.get("RELAYRL_ROUTER_HTTP", "").lower() == "uvicorn":
        import uvicorn

        return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                             access_log=False, lifespan="on",
                                             **uvicorn_options()))
    return RouterHttpServer(app, host, port, lifespan=lambda: router.lifespan(app))


def serve(config: RouterConfig) -> None:
    """Serve until interrupted, printing the address once listening."""
    router = Router(config)
    if not _loopback(config.host) and not config.tenants:
        # The router authenticates nothing itself without tenants: the gateways must.
        print("relayrl router: listening off loopback; every backend gateway must have "
              "--admin-key set", flush=True)
    server = _server(router, config.host, config.port)

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        for _ in range(600):  # bounded wait for startup (60 s)
            if server.started or task.done():
                break
            await asyncio.sleep(0.1)
        if server.started:
            host = f"[{config.host}]" if ":" in config.host else config.host
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else config.port
            healthy = sum(b.healthy for b in router.backends)
            print(f"relayrl router listening at http://{host}:{port} "
                  f"({healthy}/{len(router.backends)} backends healthy)", flush=True)
        await task

    run_server(run())


class RouterThread:
    """A router served on a loopback port in a background thread (tests, benchmarks,
    the replicas launcher). `with RouterThread(config) as r: r.url`."""

    def __init__(self, config: RouterConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.router = Router(config)
        self.server = _server(self.router, host, port)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.host = host
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The router's root URL."""
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.host}:{port}"

    def start(self, timeout_s: float = 30.0) -> RouterThread:
        """Start serving; return once the socket listens."""
        self._thread = threading.Thread(target=self.server.run, name="relayrl-router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("router did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and wait for the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> RouterThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
