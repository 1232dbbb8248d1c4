"""The router's outbound HTTP/1.1 client: a keep-alive connection pool per gateway, on asyncio
protocols and httptools' response parser.

A relayed call needs very little of a general client: one request written as one buffer, the
status, the raw headers and the body bytes as they arrive. aiohttp's client did much more per
call (request and response objects, multidicts, URL handling, tracing hooks, a stream reader)
and was the largest part of the router's own CPU per call (benchmarks/bench_router_cpu.py).
Here a call is one `transport.write` and parser callbacks filling plain lists; a streamed body
is handed on as whatever arrived in one socket read (several SSE frames of a fast stream become
one chunk, byte for byte), so a stream costs the router one wake-up per read, not per frame.

May import: httptools. Nothing of relayrl's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import Callable

import httptools

_PAUSE_AT = 4 << 20
"""Unread streamed bytes at which reading from the gateway pauses (a client slower than the
gateway must not make the router buffer a whole answer)."""


class UpstreamError(Exception):
    """The gateway failed: connection lost, no byte within the read timeout, or a bad answer."""


class UpstreamUnreachable(UpstreamError):
    """No connection to the gateway could be opened."""


class Conn(asyncio.Protocol):
    """One keep-alive connection to a gateway, and the answer it is reading (when busy)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.lost = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.pending = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.head_only = False
        self.framed = False
        """Whether the answer says where it ends (content-length or chunked); else at EOF."""
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.streaming = False
        """Read chunk by chunk (reading pauses while the reader lags); else read whole."""

    # ---------------------------------------------------------------- protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport; no Nagle delay on small writes."""
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not a TCP socket (a test's pipe)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        """Parse what arrived; wake the reader once per read, however many frames it held."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._fail(UpstreamError("the gateway's answer is not valid HTTP"))
            return
        if (self.streaming and self.pending > _PAUSE_AT and not self.paused
                and self.transport is not None):
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        """The gateway closed its side: the answer ends here (if it ends at EOF) or broke off."""
        self.lost = True  # never reused
        if self.headers_done and not self.complete and not self.framed:
            self.complete = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        """Out of the pool; a reader waiting mid-answer gets an error."""
        self.lost = True
        self.pool.forget(self)
        if not self.complete and self.error is None:
            self.error = UpstreamError("the gateway closed the connection mid-answer")
        self._wake()

    def on_header(self, name: bytes, value: bytes) -> None:
        """httptools: one header, as sent (case kept)."""
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        """httptools: the status line and headers are in."""
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:
            return  # an interim answer (100 Continue): its message completes at once
        self.headers_done = True
        for name, value in self.headers:
            lname = name.lower()
            if lname == b"content-length" or (lname == b"transfer-encoding" and b"chunked" in value.lower()):
                self.framed = True
        if self.head_only:
            self.complete = True

    def on_body(self, body: bytes) -> None:
        """httptools: body bytes (chunked framing already removed)."""
        self.chunks.append(body)
        self.pending += len(body)

    def on_message_complete(self) -> None:
        """httptools: the answer is whole (or an interim one ended: keep reading)."""
        if not self.headers_done:
            self.headers = []
            return
        self.complete = True
        # asked now: once the message is done the parser forgets (always False after)
        self.keep_alive = self.parser.should_keep_alive()

    # ---------------------------------------------------------------- the reader's side

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        timer = loop.call_later(self.pool.read_timeout_s, self._timed_out)
        try:
            await waiter
        finally:
            timer.cancel()

    def _timed_out(self) -> None:
        self._fail(UpstreamError("no answer from the gateway within the read timeout"))

    async def head(self) -> None:
        """Wait for the status and headers (raises UpstreamError)."""
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def next_chunk(self) -> bytes | None:
        """The body bytes that arrived since the last call, or None once the body is whole
        (the connection then goes back to the pool). Raises UpstreamError if it broke off."""
        self.streaming = True
        while not self.chunks:
            if self.complete:
                self.release()
                return None
            if self.error is not None:
                raise self.error
            await self._wait()
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.pending = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body (the connection then goes back to the pool; raises UpstreamError)."""
        while not self.complete:
            if self.error is not None:
                raise self.error
            await self._wait()
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.release()
        return body

    def release(self) -> None:
        """Back to the pool if the answer was read whole and the connection can carry another,
        else closed."""
        if (self.complete and not self.lost and not self.head_only and self.error is None
                and self.keep_alive and self.transport is not None
                and not self.transport.is_closing()):
            self._reset()
            self.pool.put(self)
        else:
            self.close()

    def close(self) -> None:
        """Close the connection (the gateway sees the client leave: a stream stops there)."""
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Keep-alive connections to one gateway (`host`, `port`)."""

    def __init__(self, host: str, port: int, *, tls: bool = False, connect_timeout_s: float,
                 read_timeout_s: float, idle_s: float = 4.0) -> None:
        self.host, self.port = host, port
        self.tls = ssl.create_default_context() if tls else None
        self.authority = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode()
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.idle_s = idle_s
        """A connection idle this long is not reused: the gateway (uvicorn, 5 s keep-alive by
        default) may be closing it just as a request goes out."""
        self.idle: list[Conn] = []
        self.closed = False

    def put(self, conn: Conn) -> None:
        """An idle connection, ready for another request."""
        if self.closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def forget(self, conn: Conn) -> None:
        """`conn` closed: never hand it out again."""
        if conn in self.idle:
            self.idle.remove(conn)

    def _take(self) -> Conn | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()  # the most recently used: the least likely to be closing
            if conn.lost or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self.idle_s:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        factory: Callable[[], Conn] = lambda: Conn(self)  # noqa: E731
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(factory, self.host, self.port, ssl=self.tls)
        except (OSError, TimeoutError) as e:
            raise UpstreamUnreachable(type(e).__name__) from None
        return conn

    async def request(self, method: str, target: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> Conn:
        """Send one request; return the connection once the answer's status and headers are in.
        `headers` are sent as given (after `host`); a content-length is added for a body or any
        method but GET/HEAD. Raises UpstreamError (UpstreamUnreachable: no connection)."""
        conn = self._take() or await self._connect()
        conn.head_only = method == "HEAD"
        parts = [method.encode(), b" ", target, b" HTTP/1.1\r\nhost: ", self.authority, b"\r\n"]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if body or method not in ("GET", "HEAD"):
            parts += (b"content-length: ", str(len(body)).encode(), b"\r\n")
        parts += (b"\r\n", body)
        assert conn.transport is not None
        conn.transport.write(b"".join(parts))
        try:
            await conn.head()
        except BaseException:
            conn.close()
            raise
        return conn

    async def fetch(self, method: str, target: bytes, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Status, raw headers and whole body of one request (raises UpstreamError); the
        connection is closed if the answer is not read whole (a timeout around this call)."""
        conn = await self.request(method, target, headers, body)
        status, answer_headers = conn.status, conn.headers  # read() hands conn back, reset
        try:
            content = await conn.read()
        except BaseException:
            conn.close()
            raise
        return status, answer_headers, content

    def close(self) -> None:
        """Close the idle connections; those in use close when their answer is done."""
        self.closed = True
        for conn in self.idle:
            conn.close()
        self.idle.clear()
