"""Run a gateway: resolve the model, load the engine, recover the log, serve with uvicorn.

May import: everything in `relayrl.gateway`, `relayrl.engine` (`load_engine`; torch only when it
loads a local model), `relayrl.models`, `relayrl.trajectory`, `relayrl.asgi`, uvicorn. Never client or above.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from relayrl.asgi import http_name, loop_name
from relayrl.asgi import run as run_server
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
        extra = {"url": config.engine_url} if config.engine in ("vllm", "sglang") else {}
        engine = load_engine(config.engine, path, **extra)
    log = InteractionLog(config.log_path) if config.log_path else None
    store = SessionStore(ttl_s=config.session_ttl_s, max_sessions=config.max_sessions, log=log,
                         ended_ttl_s=config.ended_ttl_s)
    if log is not None:
        log.compact()  # what closed before the restart never comes back: start from a small log
        store.adopt(log.recover())
    return GatewayDeps(config=config, renderer=renderer, engine=engine, store=store, log=log,
                       model_label=config.model_label or config.model)


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


class _Deadline:
    """One timer per connection that closes it unless `_expire` finds a reason not to (the
    timed h11 and httptools protocols below share it; `loop` and `_expire` are theirs)."""

    _deadline: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop

    def _expire(self) -> None:
        raise NotImplementedError  # each protocol decides what counts as a stalled client

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


def _timed_h11_protocol(header_timeout_s: float, body_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the timeouts uvicorn lacks: headers and body.

    uvicorn only times out idle keep-alive connections, so a client that connects and sends
    nothing, half a request line or half a body holds its connection (and a file descriptor)
    forever. Here a request's line and headers must arrive within `header_timeout_s` of its first
    byte (or of the connection), and a body may not pause longer than `body_timeout_s`; past
    either, the connection is closed. A request being answered is never timed out.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(_Deadline, H11Protocol):

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(header_timeout_s)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.SEND_BODY:  # an idle limit: every piece of body restarts it
                self._arm(body_timeout_s)
            elif state is h11.IDLE and not self.transport.is_closing():
                if self._deadline is None:  # from the first byte of a request, never extended
                    self._arm(header_timeout_s)
            else:
                self._disarm()

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY) or self.transport.is_closing():
                return
            if self.conn.their_state is h11.IDLE and self.cycle is not None \
                    and not self.cycle.response_complete:
                return  # a request is being answered (pipelined bytes wait behind it)
            if self.conn.their_state is h11.SEND_BODY and self.flow.read_paused:
                self._arm(body_timeout_s)  # we stopped reading (the app is behind), not the client
                return
            self.transport.close()

    return TimedH11Protocol


class _CoalescingTransport:
    """A transport whose writes of one event-loop turn leave as one `write` (one TCP segment).

    uvicorn writes a reply's head and body with two `transport.write` calls, and with Nagle off
    each is its own segment: the client wakes twice and the server makes two send calls per
    reply. Writes are gathered until the loop's next turn instead; everything but writing goes
    straight to the real transport.
    """

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue `data`; it leaves with the other writes of this loop turn."""
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        """Queue each of `lines`."""
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def get_write_buffer_size(self) -> int:
        """Bytes not yet sent, queued here or in the real transport."""
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def write_eof(self) -> None:
        """Send what is queued, then half-close."""
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        """Send what is queued, then close (the real transport sends its buffer first)."""
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        """Drop what is queued and close at once."""
        self._pending = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _timed_httptools_protocol(header_timeout_s: float,
                              body_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the same header and body timeouts as the h11 one."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class TimedHttpToolsProtocol(_Deadline, HttpToolsProtocol):
        _phase = "idle"  # idle (between requests), head, body, done (answering)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            coalescing = _CoalescingTransport(transport, self.loop)
            super().connection_made(coalescing)  # type: ignore[arg-type]
            self._arm(header_timeout_s)  # a connection that never sends a byte

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._phase = "head"
            if self._deadline is None:  # from the first byte of a request, never extended
                self._arm(header_timeout_s)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._phase = "body"
            self._arm(body_timeout_s)

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            self._arm(body_timeout_s)  # an idle limit: every piece of body restarts it

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._phase = "done"
            self._disarm()

        def _expire(self) -> None:
            self._deadline = None
            if self._phase == "done" or self.transport.is_closing():
                return
            if self._phase == "body" and self.flow.read_paused:
                self._arm(body_timeout_s)  # we stopped reading (the app is behind), not the client
                return
            if self._phase == "head" and self.cycle is not None \
                    and not self.cycle.response_complete:
                self._arm(header_timeout_s)  # pipelined bytes wait behind a request being answered
                return
            self.transport.close()

    return TimedHttpToolsProtocol


def timed_protocol(config: GatewayConfig) -> type[asyncio.Protocol]:
    """The gateway's HTTP protocol: httptools when installed (relayrl.asgi), else h11, each with
    the header and body timeouts."""
    if http_name() == "httptools":
        return _timed_httptools_protocol(config.header_timeout_s, config.body_timeout_s)
    return _timed_h11_protocol(config.header_timeout_s, config.body_timeout_s)


def uvicorn_config(app: Any, config: GatewayConfig, host: str, port: int) -> Any:
    """The uvicorn settings of a gateway: quiet logs, the fastest installed loop and parser, and
    header, body and keep-alive timeouts."""
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False,
        loop=loop_name(), http=timed_protocol(config),
        timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]  # float is fine
    )


def serve(config: GatewayConfig, admin_key_file: Path | None = None, *,
          control: bool = True) -> None:
    """Serve until interrupted, printing the address once listening.

    `control=False` (inference only, `relayrl serve-model`) makes no admin key: the control
    routes stay off and callers without a key are answered, unrecorded (loopback only).
    """
    import uvicorn

    from relayrl.gateway.app import create_app

    if not is_loopback(config.host) and not config.admin_key:
        raise ConfigError(
            f"refusing to listen on {config.host}, which is not loopback, with no admin key: "
            "pass --admin-key"
        )
    config, key_file = (ensure_admin_key(config, admin_key_file) if control
                        else (config, None))
    app = create_app(build_deps(config))
    server = uvicorn.Server(uvicorn_config(app, config, config.host, config.port))

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
            if key_file is not None:
                print(f"admin key (generated; send it as `Authorization: Bearer KEY`) is in "
                      f"{key_file}", flush=True)
        await task

    run_server(run())


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
        self.server = uvicorn.Server(uvicorn_config(self.app, deps.config, host, port))
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
