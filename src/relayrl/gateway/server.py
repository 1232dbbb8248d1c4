"""Run a gateway: resolve the model, load the engine, recover the log, serve with uvicorn.

May import: everything in `relayrl.gateway`, `relayrl.engine` (`load_engine`; torch only when it
loads a local model), `relayrl.models`, `relayrl.trajectory`, `relayrl.asgi`, uvicorn. Never client or above.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

from relayrl.asgi import ServerThread, serve_until_stopped, server_config
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
    owns_engine = engine is None
    if engine is None:
        extra = {"url": config.engine_url} if config.engine in ("vllm", "sglang") else {}
        engine = load_engine(config.engine, path, **extra)
    log = InteractionLog(config.log_path) if config.log_path else None
    store = SessionStore(ttl_s=config.session_ttl_s, max_sessions=config.max_sessions, log=log,
                         ended_ttl_s=config.ended_ttl_s)
    if log is not None:
        log.compact()  # what closed before the restart never comes back: start from a small log
        store.adopt(log.recover())
    return GatewayDeps(config=config, renderer=renderer, engine=engine, store=store, log=log,
                       model_label=config.model_label or config.model, owns_engine=owns_engine)


def default_admin_key_file(port: int) -> Path:
    """Where `relayrl gateway` keeps the admin key it generates: private, one file per port."""
    root = os.environ.get("XDG_RUNTIME_DIR") or str(Path.home() / ".relayrl")
    return Path(root) / "relayrl" / f"gateway-{port}.admin_key"


def ensure_admin_key(config: GatewayConfig,
                     path: Path | None = None) -> tuple[GatewayConfig, Path | None]:
    """The config with an admin key: a generated one lives in a 0600 file (reused on restart).

    A gateway without an admin key would leave start, abort, ack and export open to every local
    process, so one is always made; it goes to a file only its owner can read (as `relayrl
    serve` does under its run dir), never to stdout or the log.
    """
    if config.admin_key:
        return config, None
    path = path or default_admin_key_file(config.port)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ""
    if path.exists() and path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077 == 0:
        key = path.read_text().strip()
    if len(key) < 32:
        key = secrets.token_urlsafe(32)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.replace(tmp, path)
    return replace(config, admin_key=key), path


def uvicorn_config(app: Any, config: GatewayConfig, host: str, port: int) -> Any:
    """The uvicorn settings of a gateway: quiet logs, the fastest installed loop and parser, and
    header, body and keep-alive timeouts (`relayrl.asgi.server_config`)."""
    return server_config(app, host, port, header_timeout_s=config.header_timeout_s,
                         body_timeout_s=config.body_timeout_s,
                         keep_alive_timeout_s=config.keep_alive_timeout_s)


def serve(config: GatewayConfig, admin_key_file: Path | None = None, *,
          control: bool = True) -> None:
    """Serve until interrupted, printing the address once listening.

    `control=False` (inference only, `relayrl serve-model`) makes no admin key: the control
    routes stay off and callers without a key are answered, unrecorded (loopback only).
    """
    from relayrl.gateway.app import create_app

    if not is_loopback(config.host) and not config.admin_key:
        raise ConfigError(
            f"refusing to listen on {config.host}, which is not loopback, with no admin key: "
            "pass --admin-key"
        )
    config, key_file = (ensure_admin_key(config, admin_key_file) if control
                        else (config, None))
    app = create_app(build_deps(config))

    def listening(url: str) -> None:
        print(f"relayrl gateway listening at {url}", flush=True)
        if key_file is not None:
            print(f"admin key (generated; send it as `Authorization: Bearer KEY`) is in "
                  f"{key_file}", flush=True)

    serve_until_stopped(uvicorn_config(app, config, config.host, config.port), listening)


class GatewayThread(ServerThread):
    """A gateway served by uvicorn on a loopback port in a background thread.

    For tests, examples and the trainer, which run agents against a real HTTP server in-process.
    `with GatewayThread(deps) as gw: gw.url` (port 0 picks a free port). When it stops, an engine
    that `build_deps` made for it is closed with it; one passed to `build_deps` is left open for
    its owner.
    """

    def __init__(self, deps: GatewayDeps, host: str = "127.0.0.1", port: int = 0) -> None:
        from relayrl.gateway.app import create_app

        self.deps = deps
        self.app = create_app(deps)
        super().__init__(uvicorn_config(self.app, deps.config, host, port), name="relayrl-gateway")
