"""How relayrl runs uvicorn: the servers it starts (gateway, serve-model, rollout server,
viewer) take their event loop and HTTP parser from here, and stream server-sent events with
`EventStream`. The router serves HTTP/1.1 itself on the same loop and parser
(`relayrl.router.http`), because uvicorn's per-request work was half of its cost per call.

The fastest installed are used: uvloop and httptools (core dependencies; uvicorn's own
recommended extras), else asyncio's loop and h11. A server run in a thread gets a fresh loop
from `new_event_loop()`: uvloop loops work outside the main thread, and the callers turn off
uvicorn's signal handlers there.

May import: uvicorn, uvloop, httptools, starlette. Nothing of relayrl's.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

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
