"""How relayrl runs uvicorn: every server it starts (gateway, router, serve-model, rollout
server, viewer) takes its event loop and HTTP parser from here.

The fastest installed are used: uvloop and httptools (core dependencies; uvicorn's own
recommended extras), else asyncio's loop and h11. `RELAYRL_LOOP=asyncio` and `RELAYRL_HTTP=h11`
force the fallbacks (to measure what each costs). A server run in a thread gets a fresh loop
from `new_event_loop()`: uvloop loops work outside the main thread, and the callers turn off
uvicorn's signal handlers there.

May import: uvicorn, uvloop, httptools. Nothing of relayrl's.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def loop_name() -> str:
    """The event loop servers run on: "uvloop" when installed (and not turned off), else "asyncio"."""
    if os.environ.get("RELAYRL_LOOP", "").lower() == "asyncio":
        return "asyncio"
    return "uvloop" if _installed("uvloop") else "asyncio"


def http_name() -> str:
    """The HTTP/1.1 parser servers use: "httptools" when installed (and not turned off), else "h11"."""
    if os.environ.get("RELAYRL_HTTP", "").lower() == "h11":
        return "h11"
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
