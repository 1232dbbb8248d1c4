"""How relayrl runs uvicorn: the servers it starts (gateway, serve-model, router, rollout
server, viewer) take their event loop and HTTP parser from here, and stream server-sent events
with `EventStream`. The gateway and the router are served alike (`server_config`: uvicorn's
protocol with header and body timeouts; `ServerThread` in a background thread,
`serve_until_stopped` in the foreground).

The fastest installed are used: uvloop and httptools (core dependencies; uvicorn's own
recommended extras), else asyncio's loop and h11. A server run in a thread gets a fresh loop
from `new_event_loop()`: uvloop loops work outside the main thread, and uvicorn installs no
signal handlers there.

May import: uvicorn, uvloop, httptools, h11, starlette. Nothing of relayrl's.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def loop_name() -> str:
    """The event loop servers run on: "uvloop" when installed, else "asyncio"."""
    return "uvloop" if _installed("uvloop") else "asyncio"


def http_name() -> str:
    """The HTTP/1.1 parser servers use: "httptools" when installed, else "h11"."""
    return "httptools" if _installed("httptools") else "h11"


def uvicorn_options() -> dict[str, Any]:
    """`loop` and `http` for `uvicorn.Config` / `uvicorn.run`."""
    return {"loop": loop_name(), "http": http_name()}


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the kind `loop_name()` says."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop servers use (for a server served from our own coroutine)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)


class EventStream(StreamingResponse):
    """A `StreamingResponse` that notices a client leaving with one plain task.

    uvicorn speaks ASGI 2.3, where sending to a gone client does not fail, so Starlette runs
    every stream in an anyio task group beside a task listening for the disconnect; that costs
    about a tenth of a short streamed call. Here a bare asyncio task listens instead and, if the
    client leaves, cancels the streaming task and closes the generator (so the engine stops and the
    call is noted as aborted, never recorded as finished) and the cancellation is absorbed.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None  # ASGI apps run in a task
        state = StreamState()
        watcher = asyncio.create_task(watch_disconnect(receive, streaming, state))
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not state.client_left:
                raise
            streaming.uncancel()
            # close the body now, not when it is collected: its cleanup stops the engine and
            # notes the call as aborted (a cancel while awaiting `send` leaves it suspended)
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                await closer()
        finally:
            state.done = True
            watcher.cancel()
        if self.background is not None:
            await self.background()


@dataclass
class StreamState:
    """Where a streamed answer stands, shared with its disconnect watcher."""

    done: bool = False
    """The response went out whole (a disconnect seen after that changes nothing)."""
    client_left: bool = False
    """The watcher saw the client leave and cancelled the stream."""


async def watch_disconnect(receive: Receive, streaming: asyncio.Task[Any],
                           state: StreamState) -> None:
    """Cancel `streaming` when the client leaves before the answer went out whole."""
    # The body was read before streaming began, so what is left is the disconnect; the bound
    # only guards against a server that keeps sending other messages.
    for _ in range(1 << 16):
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    else:
        return
    if not state.done:
        state.client_left = True
        streaming.cancel()


# ---------------------------------------------------------------- uvicorn with timeouts

class _Deadline:
    """One timer per connection that closes it unless `_expire` finds a reason not to (the
    timed h11 and httptools protocols below share it; `loop` and `_expire` are theirs)."""

    _deadline: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop

    def _expire(self) -> None:
        raise NotImplementedError  # each protocol decides what counts as a stalled client

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        # a mixin: the uvicorn protocol after it in the MRO has connection_lost
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

        # narrows BaseTransport to Transport, as uvicorn's own connection_made does
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

        # narrows BaseTransport to Transport, as uvicorn's own connection_made does
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            coalescing = _CoalescingTransport(transport, self.loop)
            # a wrapper with every Transport method uvicorn's protocol calls, not a subclass
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


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol for `http_name()`'s parser, with header and body timeouts."""
    if http_name() == "httptools":
        return _timed_httptools_protocol(header_timeout_s, body_timeout_s)
    return _timed_h11_protocol(header_timeout_s, body_timeout_s)


def server_config(app: Any, host: str, port: int, *, header_timeout_s: float = 10.0,
                  body_timeout_s: float = 30.0, keep_alive_timeout_s: float = 5.0) -> Any:
    """A `uvicorn.Config` as relayrl's servers use it: quiet logs, the fastest installed loop and
    parser, and header, body and keep-alive timeouts."""
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False,
        loop=loop_name(), http=timed_protocol(header_timeout_s, body_timeout_s),
        # uvicorn annotates an int; it only hands the value to loop.call_later, which takes floats
        timeout_keep_alive=keep_alive_timeout_s,  # type: ignore[arg-type]
    )


def _url(server: Any, host: str) -> str:
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_until_stopped(config: Any, listening: Callable[[str], None]) -> None:
    """Serve `config` (a `uvicorn.Config`) in the foreground until interrupted; call
    `listening(url)` once the socket listens (within 60 s of the start)."""
    import uvicorn

    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        for _ in range(600):  # bounded wait for startup (60 s)
            if server.started or task.done():
                break
            await asyncio.sleep(0.1)
        if server.started:
            listening(_url(server, config.host))
        await task

    run(main())


class ServerThread:
    """A uvicorn server on a loopback port in a background thread (tests, examples, launchers).

    `with ServerThread(config) as s: s.url`; port 0 in `config` picks a free port.
    """

    def __init__(self, config: Any, name: str = "relayrl-server") -> None:
        import uvicorn

        self.server = uvicorn.Server(config)  # outside the main thread it leaves signals alone
        self.host: str = config.host
        self.name = name
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The server's root URL."""
        return _url(self.server, self.host)

    def start(self, timeout_s: float = 30.0) -> Self:
        """Start serving; return once the socket listens."""
        self._thread = threading.Thread(target=self.server.run, name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.name} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and wait for the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
