"""The router's inbound HTTP/1.1 server: a small ASGI server on asyncio protocols and httptools'
request parser, for the one app it serves.

Profiled in `relayrl router` under benchmarks/bench_router.py, uvicorn's per-request Python
(cycle objects, events, header checks, the proxy-headers middleware) was about half of the
router's own Python time per call, and it writes a response's head and body in two socket
writes (two segments, two wake-ups of the client). Here a request is parsed by callbacks into a
scope, the app runs in one task, and a response's head goes out with its first body bytes in
one write. Keep-alive, pipelined requests (answered in order), `Expect: 100-continue`, chunked
request and response bodies, write back-pressure, an idle timeout and a client leaving
(`http.disconnect`) are handled; HTTP/2, TLS and upgrades are not (a router in front of
gateways on one machine or one network does not need them; a TLS proxy goes in front).
`RELAYRL_ROUTER_HTTP=uvicorn` serves the router with uvicorn instead.

May import: httptools, relayrl.asgi (the event loop). Nothing else of ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import signal
import socket
import time
from collections import deque
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import httptools

from relayrl.asgi import run as run_loop

log = logging.getLogger("relayrl.router")

_STATUS = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus}
_ERROR_500 = (b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain; charset=utf-8\r\n"
              b"content-length: 21\r\nconnection: close\r\n\r\nInternal Server Error")
_ERROR_400 = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
              b"content-length: 11\r\nconnection: close\r\n\r\nBad Request")
_TRUSTED = frozenset({"127.0.0.1", "::1"})
"""Peers whose `x-forwarded-proto` is believed (a proxy on this machine)."""
_BODY_PAUSE = 1 << 20
"""Unread request-body bytes at which reading from the client pauses."""

App = Callable[[dict[str, Any], Any, Any], Coroutine[Any, Any, None]]


class _Date:
    """The `date` header, formatted once a second."""

    def __init__(self) -> None:
        self.second = 0
        self.line = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self.line


_date = _Date()


class _Cycle:
    """One request and its response: the ASGI `receive` and `send` of one app call."""

    __slots__ = ("body", "body_done", "chunked", "conn", "delivered", "disconnected", "head",
                 "keep_alive", "length_left", "response_complete", "scope", "started",
                 "status_headers", "waiter")

    def __init__(self, conn: HttpConn, scope: dict[str, Any], keep_alive: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.head = scope["method"] == "HEAD"
        self.body: list[bytes] = []
        self.body_done = False
        self.delivered = False
        self.disconnected = False
        self.waiter: asyncio.Future[None] | None = None
        self.status_headers: bytes | None = None
        self.started = False
        self.chunked = False
        self.length_left: int | None = None
        self.response_complete = False

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def run(self, app: App) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:  # the loop is shutting down
            self.keep_alive = False
            raise
        except Exception:
            log.exception("router HTTP: unhandled error in the app")
            if not self.started and not self.disconnected:
                self.conn.write(_ERROR_500)
            self.keep_alive = False
        else:
            if not self.response_complete:
                if not self.started and not self.disconnected:
                    log.error("router HTTP: the app returned without answering")
                    self.conn.write(_ERROR_500)
                self.keep_alive = False  # an answer cut short cannot be followed by another
        finally:
            self.conn.cycle_done(self)

    async def receive(self) -> dict[str, Any]:
        """ASGI receive: the body as it arrives, then `http.disconnect` once the client left
        (or the response is complete)."""
        while not self.delivered:
            if self.disconnected:
                break
            if self.body or self.body_done:
                body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
                self.body = []
                self.delivered = self.body_done
                self.conn.body_read()
                return {"type": "http.request", "body": body, "more_body": not self.body_done}
            await self._wait()
        while not (self.disconnected or self.response_complete):
            await self._wait()
        return {"type": "http.disconnect"}

    async def _wait(self) -> None:
        waiter = self.waiter = asyncio.get_running_loop().create_future()
        await waiter

    async def send(self, message: dict[str, Any]) -> None:
        """ASGI send: the head is held until the first body bytes and written with them."""
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self._head(message["status"], message.get("headers", ()))
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started or self.response_complete:
            raise RuntimeError("http.response.body outside a response")
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if not more:
            self.response_complete = True
            self.wake()  # a receive() waiting for the end learns it
        if self.disconnected:
            return
        head = self.status_headers
        if head is not None:
            self.status_headers = None
            if self.length_left is None and not self.chunked:
                if more:
                    self.chunked = True
                    head += b"transfer-encoding: chunked\r\n"
                else:
                    self.length_left = len(body)
                    head += b"content-length: %d\r\n" % len(body)
            head += b"\r\n"
        if self.head:
            out = head or b""
        elif self.chunked:
            out = (head or b"") + (b"%x\r\n%s\r\n" % (len(body), body) if body else b"")
            if not more:
                out += b"0\r\n\r\n"
        else:
            assert self.length_left is not None
            self.length_left -= len(body)
            if self.length_left < 0 or (not more and self.length_left):
                self.keep_alive = False  # the app's content-length was wrong
            out = head + body if head is not None else body
        if out:
            self.conn.write(out)
        if self.conn.write_paused:
            await self.conn.drain()

    def _head(self, status: int, headers: Any) -> None:
        parts = [_STATUS.get(status) or b"HTTP/1.1 %d \r\n" % status, _date()]
        close = not self.keep_alive
        for name, value in headers:
            lname = name.lower()
            if lname == b"content-length":
                self.length_left = int(value)
            elif lname == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()
            elif lname == b"connection" and b"close" in value.lower():
                self.keep_alive, close = False, False  # said already
            parts += (name, b": ", value, b"\r\n")
        if close:
            parts.append(b"connection: close\r\n")
        if status in (204, 304) or 100 <= status < 200:
            self.length_left = 0  # no body, whatever the app sends
            self.head = True
        self.status_headers = b"".join(parts)


class HttpConn(asyncio.Protocol):
    """One client connection: requests parsed as they arrive, answered one at a time."""

    def __init__(self, server: RouterHttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.forwarded_proto: bytes | None = None
        self.parsing: _Cycle | None = None
        self.cycle: _Cycle | None = None
        self.queued: deque[_Cycle] = deque()
        self.buffered = 0
        self.read_paused = False
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None
        self.idle: asyncio.TimerHandle | None = None
        """The one timer: keep-alive between requests, else the header or body deadline."""
        self.phase = "idle"
        """idle (between requests), head, body, done (the request is whole)."""
        self.task: asyncio.Task[None] | None = None
        """The app call in progress (held: the loop keeps only weak references to tasks)."""
        self.closed = False
        self.client: tuple[str, int] | None = None
        self.sockname: tuple[str, int] | None = None

    # ---------------------------------------------------------------- transport callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Start: no Nagle delay, addresses for the scope, the idle timer."""
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not a TCP socket
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        name = transport.get_extra_info("sockname")
        self.client = tuple(peer[:2]) if isinstance(peer, tuple) else None  # type: ignore[assignment]
        self.sockname = tuple(name[:2]) if isinstance(name, tuple) else None  # type: ignore[assignment]
        self.server.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        """Feed the parser (its callbacks below start the app)."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject()
        except httptools.HttpParserError:
            self._reject()

    def connection_lost(self, exc: Exception | None) -> None:
        """The client left: every cycle of this connection learns it (`http.disconnect`)."""
        self.closed = True
        self.server.connections.discard(self)
        if self.idle is not None:
            self.idle.cancel()
        for cycle in (self.cycle, self.parsing, *self.queued):
            if cycle is not None:
                cycle.disconnected = True
                cycle.wake()
        self.queued.clear()
        self._drained()

    def pause_writing(self) -> None:
        """The client reads slower than we write: `send` waits."""
        self.write_paused = True

    def resume_writing(self) -> None:
        """The client caught up."""
        self.write_paused = False
        self._drained()

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        """httptools: a new request: its line and headers must arrive within the header timeout
        (from its first byte, never extended), so a client cannot hold a connection open by
        sending a head a byte at a time."""
        self.url = b""
        self.headers = []
        self.forwarded_proto = None
        self.phase = "head"
        self._arm(self.server.header_timeout_s, self._expire)

    def on_url(self, url: bytes) -> None:
        """httptools: (part of) the request target."""
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        """httptools: one header (names lowercased, as ASGI has them)."""
        name = name.lower()
        if name == b"x-forwarded-proto":
            self.forwarded_proto = value
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        """httptools: the head is in: the app starts now (it reads the body as it comes)."""
        url = self.url
        if url[:1] == b"/":
            raw_path, _, query = url.partition(b"?")
        else:  # absolute form (a client speaking to a proxy)
            parsed = httptools.parse_url(url)
            raw_path, query = parsed.path or b"/", parsed.query or b""
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        scheme = "http"
        if self.forwarded_proto is not None and self.client and self.client[0] in _TRUSTED:
            # a TLS proxy on this machine: the URLs the router hands out (a session's base_url)
            # must carry the scheme clients used, as uvicorn's proxy-headers default does
            proto = self.forwarded_proto.rsplit(b",", 1)[-1].strip().lower()
            if proto in (b"http", b"https"):
                scheme = proto.decode()
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.parser.get_http_version(), "server": self.sockname,
            "client": self.client, "scheme": scheme,
            "method": self.parser.get_method().decode("ascii"), "root_path": "",
            "path": path, "raw_path": raw_path, "query_string": query,
            "headers": self.headers, "state": self.server.state.copy(),
        }
        cycle = _Cycle(self, scope, self.parser.should_keep_alive())
        self.phase = "body"
        self._arm(self.server.body_timeout_s, self._expire)
        self.parsing = cycle
        if self.cycle is None:
            self._start(cycle)
        else:  # pipelined: answered after the one in progress
            self.queued.append(cycle)

    def on_body(self, body: bytes) -> None:
        """httptools: request body bytes (chunked framing removed)."""
        cycle = self.parsing
        if cycle is None:
            return
        self._arm(self.server.body_timeout_s, self._expire)  # an idle limit: each piece restarts it
        cycle.body.append(body)
        self.buffered += len(body)
        if self.buffered > _BODY_PAUSE and not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        """httptools: the request is whole."""
        self.phase = "done"
        self._disarm()
        cycle = self.parsing
        if cycle is not None:
            cycle.body_done = True
            self.parsing = None
            cycle.wake()

    # ---------------------------------------------------------------- the app's side

    def _start(self, cycle: _Cycle) -> None:
        self.cycle = cycle
        if any(n == b"expect" and v.lower() == b"100-continue" for n, v in cycle.scope["headers"]):
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.task = self.loop.create_task(cycle.run(self.server.app))

    def cycle_done(self, cycle: _Cycle) -> None:
        """A response is done: the next queued request runs, or the connection idles."""
        self.cycle = self.task = None
        if self.closed:
            return
        if not cycle.keep_alive or not cycle.body_done:
            # a request body left unread cannot be skipped safely: close instead
            self._close()
            return
        if self.queued:
            self._start(self.queued.popleft())
        elif self.phase == "done":  # not while a pipelined request's head or body arrives
            self.phase = "idle"
            self._arm_idle()

    def body_read(self) -> None:
        """The app took the buffered body: read on."""
        self.buffered = 0
        if self.read_paused and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        """Write to the client (dropped once it left)."""
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait until the client reads again (or left)."""
        if self.write_paused and not self.closed:
            self.drained = self.loop.create_future()
            await self.drained

    def _drained(self) -> None:
        waiter, self.drained = self.drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm_idle(self) -> None:
        self._arm(self.server.keep_alive_s, self._close)

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        if self.idle is not None:
            self.idle.cancel()
        self.idle = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None

    def _expire(self) -> None:
        """A header or body deadline passed: close, unless the wait is ours."""
        self.idle = None
        if self.closed or self.phase not in ("head", "body"):
            return
        if self.phase == "body" and self.read_paused:
            self._arm(self.server.body_timeout_s, self._expire)  # we stopped reading, not they
            return
        if self.phase == "head" and self.cycle is not None:
            self._arm(self.server.header_timeout_s, self._expire)  # pipelined behind an answer
            return
        log.info("router: closing a connection whose request %s did not arrive in time",
                 "head" if self.phase == "head" else "body")
        self._close()

    def _reject(self) -> None:
        if self.cycle is None or not self.cycle.started:
            self.write(_ERROR_400)
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def shutdown(self) -> None:
        """Server stopping: an idle connection closes now, a busy one after its answer."""
        if self.cycle is None:
            self._close()
        else:
            self.cycle.keep_alive = False


class RouterHttpServer:
    """Serve one ASGI app on `host:port` (attributes as `uvicorn.Server` has them, so callers
    can use either): `run()` in a thread, or `await serve()`; `should_exit` stops it."""

    def __init__(self, app: App, host: str, port: int,
                 lifespan: Callable[[], AbstractAsyncContextManager[None]] | None = None,
                 keep_alive_s: float = 5.0, graceful_s: float = 5.0,
                 header_timeout_s: float = 10.0, body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.host, self.port = host, port
        self.lifespan = lifespan
        self.keep_alive_s = keep_alive_s
        self.header_timeout_s = header_timeout_s
        """A request's line and headers must arrive within this (the gateway's default)."""
        self.body_timeout_s = body_timeout_s
        """Longest silence while a request body is arriving."""
        self.graceful_s = graceful_s
        self.state: dict[str, Any] = {}
        self.connections: set[HttpConn] = set()
        self.servers: list[asyncio.AbstractServer] = []
        self.started = False
        self.should_exit = False
        self.install_signal_handlers: Callable[[], None] = self._signals

    def run(self) -> None:
        """Serve until `should_exit` (on a fresh event loop of the kind servers use)."""
        run_loop(self.serve())

    def _signals(self) -> None:
        # signal.signal, as uvicorn does: a flag the serve loop polls (uvloop's
        # add_signal_handler did not fire for SIGTERM here)
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(sig, self._exit)

    def _exit(self, *_: object) -> None:
        self.should_exit = True

    async def serve(self) -> None:
        """Run the lifespan, listen, serve until `should_exit`, then stop gracefully."""
        self.install_signal_handlers()
        async with contextlib.AsyncExitStack() as stack:
            if self.lifespan is not None:
                await stack.enter_async_context(self.lifespan())
            server = await asyncio.get_running_loop().create_server(
                lambda: HttpConn(self), self.host, self.port, reuse_address=True, backlog=2048)
            self.servers = [server]
            self.started = True
            try:
                while not self.should_exit:  # polled, as uvicorn does
                    await asyncio.sleep(0.1)
            finally:
                server.close()
                for conn in list(self.connections):
                    conn.shutdown()
                deadline = time.monotonic() + self.graceful_s
                while self.connections and time.monotonic() < deadline:  # bounded
                    await asyncio.sleep(0.05)
                for conn in list(self.connections):
                    if conn.transport is not None:
                        conn.transport.abort()
                await server.wait_closed()
