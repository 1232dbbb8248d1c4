"""Run a gateway: resolve the model, load the engine, recover the log, serve with uvicorn.

May import: everything in `relayrl.gateway`, `relayrl.engine` (`load_engine`; torch only when it
loads a local model), `relayrl.models`, `relayrl.trajectory`, uvicorn. Never client or above.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time

from relayrl.errors import ConfigError
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.core import GatewayDeps


def is_loopback(host: str) -> bool:
    """Whether `host` names only loopback addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except socket.gaierror:
            return False
        return all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def build_deps(config: GatewayConfig, engine=None) -> GatewayDeps:
    """Everything the app needs: renderer, engine (unless given), session store, durable log."""
    from relayrl.chat.renderer import Renderer
    from relayrl.engine import load_engine
    from relayrl.gateway.session_store import SessionStore
    from relayrl.models import model_path
    from relayrl.trajectory import InteractionLog

    path = model_path(config.model)
    renderer = Renderer.from_pretrained(path)
    if engine is None:
        engine = load_engine(config.engine, path)
    log = InteractionLog(config.log_path) if config.log_path else None
    store = SessionStore(ttl_s=config.session_ttl_s, max_sessions=config.max_sessions, log=log,
                         ended_ttl_s=config.ended_ttl_s)
    if log is not None:
        log.compact()  # what closed before the restart never comes back: start from a small log
        store.adopt(log.recover())
    return GatewayDeps(config=config, renderer=renderer, engine=engine, store=store, log=log,
                       model_label=config.model_label or config.model)


def serve(config: GatewayConfig) -> None:
    """Serve until interrupted, printing the address once listening."""
    import uvicorn

    from relayrl.gateway.app import create_app

    if not is_loopback(config.host) and not config.admin_key:
        raise ConfigError(
            f"refusing to listen on {config.host}, which is not loopback, with no admin key: "
            "pass --admin-key"
        )
    app = create_app(build_deps(config))
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level="warning", access_log=False))

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        for _ in range(600):  # bounded wait for startup (60 s)
            if server.started or task.done():
                break
            await asyncio.sleep(0.1)
        if server.started:
            host = f"[{config.host}]" if ":" in config.host else config.host
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else config.port
            print(f"relayrl gateway listening at http://{host}:{port}", flush=True)
        await task

    asyncio.run(run())


class GatewayThread:
    """A gateway served by uvicorn on a loopback port in a background thread.

    For tests, examples and the trainer, which run agents against a real HTTP server in-process.
    `with GatewayThread(deps) as gw: gw.url` (port 0 picks a free port).
    """

    def __init__(self, deps: GatewayDeps, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        from relayrl.gateway.app import create_app

        self.deps = deps
        self.app = create_app(deps)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port,
                                                    log_level="warning", access_log=False))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.host = host
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The gateway's root URL."""
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.host}:{port}"

    def start(self, timeout_s: float = 30.0) -> GatewayThread:
        """Start serving; return once the socket listens."""
        self._thread = threading.Thread(target=self.server.run, name="relayrl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and wait for the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
