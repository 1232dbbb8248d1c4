"""The gateway's upkeep: the durable log is compacted on its own as sessions close, and an engine
the gateway made is closed when it shuts down."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from relayrl.engine.fake import FakeEngine
from relayrl.errors import EngineError
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.trajectory import InteractionLog
from relayrl.types import GenerateRequest, SamplingParams

from .conftest import ADMIN, fake_gateway


def _one_call(url: str, key: str, text: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                   json={"model": "m", "messages": [{"role": "user", "content": text}]})
    r.raise_for_status()


def test_the_log_is_compacted_as_sessions_close_and_a_restart_keeps_the_rest(
        model_dir: str, tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    # a short TTL makes the upkeep loop tick every 2 s; two closed sessions trigger compaction
    g = fake_gateway(model_dir, str(path), session_ttl_s=8.0, compact_after_closed=2)
    admin = {"authorization": f"Bearer {ADMIN}"}
    try:
        sessions = [g.start_session(task_id=f"t{i}") for i in range(4)]
        for s in sessions:
            _one_call(g.url, s["api_key"], s["session_id"])
        with httpx.Client(base_url=g.url, headers=admin) as c:
            ended = sessions[3]
            httpx.post(g.url + "/rl/end_session", headers={
                "authorization": f"Bearer {ended['api_key']}"}).raise_for_status()
            c.post("/export_trajectories", json={"session_id": sessions[0]["session_id"],
                                                 "ack": True}).raise_for_status()
            c.post("/rl/abort_session",
                   json={"session_id": sessions[1]["session_id"]}).raise_for_status()
        upkeep = g.thread.app.state.upkeep
        deadline = time.monotonic() + 10
        while upkeep.compactions == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert upkeep.compactions == 1
        with InteractionLog(path) as log:
            # only the open and the ended session's events are left
            assert {s.id for s in log.recover(include_closed=True)} == {
                sessions[2]["session_id"], ended["session_id"]}
    finally:
        g.thread.stop()
    # a restart on the compacted log: exactly the unacknowledged sessions come back
    g2 = fake_gateway(model_dir, str(path))
    try:
        assert {s.id: str(s.state) for s in g2.deps.store} == {
            sessions[2]["session_id"]: "open", ended["session_id"]: "ended"}
        assert all(len(s.interactions) == 1 for s in g2.deps.store)
    finally:
        g2.thread.stop()


async def test_memory_is_handed_back_once_as_many_sessions_went_as_are_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl import heap
    from relayrl.gateway.session_store import SessionStore
    from relayrl.gateway.upkeep import Upkeep

    if heap.MALLOC_TRIM is None:
        pytest.skip("this C library has no malloc_trim")  # musl, macOS: nothing to hand back
    monkeypatch.setattr(heap, "_kept", False)  # a gateway alone (a trainer in this process may keep it)
    now = [0.0]
    store = SessionStore(ttl_s=10.0, clock=lambda: now[0])
    cleared: list[str] = []
    up = Upkeep(store, None, trim_after_forgotten=3, caches=(lambda: cleared.append("c"),))
    sessions = [store.start_session() for _ in range(5)]
    await up.tick()
    assert up.trims == 0  # nothing forgotten yet
    for s in sessions[:2]:
        store.acknowledge(s.id)  # forgotten at once; 3 still held
    await up.tick()
    assert up.trims == 0 and cleared == []  # 2 forgotten < min(3, 3 held)
    store.acknowledge(sessions[2].id)
    await up.tick()
    assert up.trims == 1 and cleared == ["c"]  # 3 forgotten >= min(3, 2 held)
    now[0] = 100.0  # the last two expire (aborted), then are forgotten after the TTL
    await up.tick()
    assert up.trims == 1 and store.stats()["aborted"] == 2
    now[0] = 200.0
    await up.tick()
    assert up.trims == 2 and len(store) == 0 and cleared == ["c", "c"]
    await up.tick()
    assert up.trims == 2  # a quiet gateway does not trim again


async def test_a_process_that_keeps_its_heap_for_training_does_not_trim_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from relayrl import heap
    from relayrl.gateway.session_store import SessionStore
    from relayrl.gateway.upkeep import Upkeep

    trims: list[int] = []
    monkeypatch.setattr(heap, "MALLOC_TRIM", trims.append)
    monkeypatch.setattr(heap, "_kept", True)
    store = SessionStore(ttl_s=10.0)
    cleared: list[str] = []
    up = Upkeep(store, None, trim_after_forgotten=1, caches=(lambda: cleared.append("c"),))
    for s in [store.start_session() for _ in range(4)]:
        store.acknowledge(s.id)  # every session forgotten: a trim would be due
    await up.tick()
    assert up.trims == 0 and trims == [] and cleared == []
    monkeypatch.setattr(heap, "_kept", False)
    await up.tick()
    assert up.trims == 1 and trims == [0] and cleared == ["c"]


def _generate(engine: FakeEngine) -> None:
    asyncio.run(engine.generate(GenerateRequest(prompt_ids=[1, 2, 3],
                                                params=SamplingParams(max_new_tokens=2))))


def test_an_engine_the_gateway_made_is_closed_with_it_one_passed_in_is_not(
        model_dir: str) -> None:
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN)
    made = GatewayThread(build_deps(cfg)).start()
    engine = made.deps.engine
    made.stop()
    # a leaked engine kept its model and serving thread: 1.6 GB a gateway for the 0.5B model
    with pytest.raises(EngineError, match="closed"):
        _generate(engine)
    mine = FakeEngine(tokenizer_path=model_dir)
    passed = GatewayThread(build_deps(cfg, engine=mine)).start()
    passed.stop()
    _generate(mine)  # still serving: its owner closes it
