"""Many rollouts at once: the semaphore bounds them; the tokenizer cache loads each name once."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from relayrl.remote_rollout.tokenizer import TokenizerCache, TokenizerLoadError

from .conftest import AppThread, start_rollout_server


class FakeTrainer:
    """A completions endpoint that answers after a pause and records how many calls overlap."""

    def __init__(self, pause_s: float = 0.02) -> None:
        self.pause_s = pause_s
        self.active = 0
        self.peak = 0
        self.calls = 0
        self.masks: list[object] = []

    async def completions(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.active += 1
        self.calls += 1
        self.peak = max(self.peak, self.active)
        self.masks.append(body.get("response_mask"))
        try:
            await asyncio.sleep(self.pause_s)
        finally:
            self.active -= 1
        return JSONResponse({"id": "c", "choices": [{"index": 0, "finish_reason": "stop",
                                                     "message": {"role": "assistant",
                                                                 "content": "done"}}],
                             "token_ids": [1, 2, 3], "prompt_token_ids": [4]})

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.completions,
                                       methods=["POST"])])


def test_concurrent_rollouts_are_bounded_by_the_semaphore() -> None:
    trainer = FakeTrainer()
    trainer_thread = AppThread(trainer.app()).start()
    server, state = start_rollout_server(max_concurrent_rollouts=10)
    n = 120

    async def fire() -> list[dict]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as c:
            bodies = [{"rollout_id": f"r{i}", "server_url": trainer_thread.url,
                       "messages": [{"role": "user", "content": f"question {i}"}]}
                      for i in range(n)]
            rs = await asyncio.gather(*(c.post(f"{server.url}/rollout", json=b) for b in bodies))
            return [r.json() for r in rs]

    try:
        start = time.monotonic()
        results = asyncio.run(fire())
        elapsed = time.monotonic() - start
    finally:
        server.stop()
        trainer_thread.stop()
    assert [r["status"] for r in results] == ["COMPLETED"] * n
    assert sorted(r["rollout_id"] for r in results) == sorted(f"r{i}" for i in range(n))
    assert trainer.calls == n and trainer.masks == [None] * n
    # never more than 10 in flight, and the 120 did overlap up to the bound
    assert state.peak_active == 10 and trainer.peak <= 10
    assert trainer.peak >= 5
    assert state.active == 0 and state.completed == n
    assert elapsed < 60


def test_cache_evicts_least_recently_used() -> None:
    loaded: list[str] = []

    def loader(name: str) -> object:
        loaded.append(name)
        return object()

    async def go() -> TokenizerCache:
        cache = TokenizerCache(2, loader)  # type: ignore[arg-type]
        a = await cache.get("a")
        await cache.get("b")
        assert await cache.get("a") is a  # a is now the most recent
        await cache.get("c")              # evicts b
        assert cache.names() == ["a", "c"]
        await cache.get("b")              # reloaded, evicts a
        assert cache.names() == ["c", "b"]
        return cache

    cache = asyncio.run(go())
    assert loaded == ["a", "b", "c", "b"]
    assert cache.loads == 4 and cache.evictions == 2


def test_concurrent_first_load_loads_once() -> None:
    calls: list[str] = []
    threads: set[str] = set()

    def slow_loader(name: str) -> object:
        calls.append(name)
        threads.add(threading.current_thread().name)
        time.sleep(0.2)  # long enough that every task asks while the load is under way
        return object()

    async def go() -> list[object]:
        cache = TokenizerCache(5, slow_loader)  # type: ignore[arg-type]
        ticker = 0

        async def tick() -> None:
            nonlocal ticker
            for _ in range(10):  # the loop keeps running while the loader sleeps in a thread
                await asyncio.sleep(0.01)
                ticker += 1

        got = await asyncio.gather(tick(), *(cache.get("tok") for _ in range(50)))
        assert ticker == 10
        return list(got[1:])

    results = asyncio.run(go())
    assert calls == ["tok"]
    assert all(r is results[0] for r in results)
    assert threading.main_thread().name not in threads


def test_cache_load_error_is_not_cached() -> None:
    attempts = 0

    def flaky(name: str) -> object:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise TokenizerLoadError("first try fails")
        return object()

    async def go() -> None:
        cache = TokenizerCache(2, flaky)  # type: ignore[arg-type]
        with pytest.raises(TokenizerLoadError):
            await cache.get("t")
        assert "t" not in cache
        await cache.get("t")
        assert "t" in cache

    asyncio.run(go())
