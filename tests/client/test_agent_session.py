"""AgentSession against a real gateway on loopback: every client library's calls land in the
session of the block they are made in, and only there; exits finalize, exceptions abort."""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from typing import Any

import aiohttp
import anthropic
import httpx
import openai
import pytest

from relayrl.client import AgentSession
from relayrl.errors import CapacityExhausted, SessionClosed
from relayrl.trajectory import SessionState
from tests.client.conftest import admin_headers
from tests.gateway.conftest import ADMIN, Gateway, fake_gateway

NOT_A_KEY = "sk-not-a-session-key"

TIMEOUT = httpx.Timeout(120.0, connect=60.0)
"""Generous: 32 sessions at once on a loaded 2-core machine must not time out on connect."""
SDK_TIMEOUT = 120.0
"""The same for the openai and anthropic SDKs (their connect timeout is 5 s by default)."""


def texts(gw: Gateway, session_id: str) -> list[str]:
    """The decoded prompt+output of each call recorded in a session, from its export."""
    rows = gw.export(session_id, style="individual")
    return [gw.deps.renderer.decode(r["input_ids"]) for r in rows]


def stored(gw: Gateway, session_id: str) -> Any:
    return gw.deps.store.get(session_id, touch=False)


def chat_body(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8}


def call_sync(kind: str, url: str, text: str) -> None:
    """One chat call to the gateway at `url` through a blocking client, with no session key."""
    if kind == "openai_sync":
        client = openai.OpenAI(base_url=url + "/v1", api_key=NOT_A_KEY, max_retries=0, timeout=SDK_TIMEOUT)
        client.chat.completions.create(**chat_body(text))
    elif kind == "anthropic_sync":
        a = anthropic.Anthropic(base_url=url, api_key=NOT_A_KEY, max_retries=0, timeout=SDK_TIMEOUT)
        a.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": text}])
    elif kind == "httpx_sync":
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            c.post("/v1/chat/completions", json=chat_body(text)).raise_for_status()
    else:
        raise AssertionError(kind)


async def call_async(kind: str, url: str, text: str) -> None:
    """One chat call to the gateway at `url` through an async client (or a sync one in a
    context-copying thread), with no session key."""
    if kind == "openai_async":
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=NOT_A_KEY, max_retries=0, timeout=SDK_TIMEOUT)
        await client.chat.completions.create(**chat_body(text))
        await client.close()
    elif kind == "anthropic_async":
        a = anthropic.AsyncAnthropic(base_url=url, api_key=NOT_A_KEY, max_retries=0, timeout=SDK_TIMEOUT)
        await a.messages.create(model="m", max_tokens=8,
                                messages=[{"role": "user", "content": text}])
        await a.close()
    elif kind == "httpx_async":
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as c:
            (await c.post("/v1/chat/completions", json=chat_body(text))).raise_for_status()
    elif kind == "aiohttp":
        async with (aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=120)) as c,
                    c.post("/v1/chat/completions", json=chat_body(text)) as r):
            assert r.status == 200, await r.text()
    else:
        await asyncio.to_thread(call_sync, kind, url, text)


ASYNC_KINDS = ["openai_async", "anthropic_async", "httpx_async", "aiohttp"]
SYNC_KINDS = ["openai_sync", "anthropic_sync", "httpx_sync"]


@pytest.mark.parametrize("kind", ASYNC_KINDS + SYNC_KINDS)
async def test_each_client_library_lands_in_the_async_session(svc: Gateway, kind: str) -> None:
    async with AgentSession(svc.url, ADMIN) as s:
        await call_async(kind, svc.url, f"hello from {kind}")
    assert s.state == "ended"
    [text] = texts(svc, s.session_id)
    assert f"hello from {kind}" in text
    # the same call outside any session carries only its own (unknown) key: refused
    with pytest.raises(Exception, match=r"(?i)401|authentication|session key"):
        await call_async(kind, svc.url, "outside")


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_each_sync_client_lands_in_a_sync_session(svc: Gateway, kind: str) -> None:
    with AgentSession(svc.url, ADMIN) as s:
        call_sync(kind, svc.url, f"sync {kind}")
        call_sync(kind, svc.url, f"again {kind}")
    assert stored(svc, s.session_id).state == SessionState.ENDED
    got = texts(svc, s.session_id)
    assert len(got) == 2 and f"sync {kind}" in got[0] and f"again {kind}" in got[1]


async def test_32_concurrent_sessions_never_mix(svc: Gateway) -> None:
    kinds = ASYNC_KINDS + SYNC_KINDS
    rng = random.Random(3)
    delays = [[rng.uniform(0, 0.05) for _ in range(2)] for _ in range(32)]

    async def episode(i: int) -> str:
        kind = kinds[i % len(kinds)]
        async with AgentSession(svc.url, ADMIN, group_id=f"g{i % 4}") as s:
            for turn in range(2):
                await asyncio.sleep(delays[i][turn])  # interleave the sessions' calls
                await call_async(kind, svc.url, f"tag{i:02d}x turn {turn}")
        return s.session_id

    ids = await asyncio.gather(*(episode(i) for i in range(32)))
    assert len(set(ids)) == 32
    for i, sid in enumerate(ids):
        got = texts(svc, sid)
        assert len(got) == 2, (i, got)
        assert {int(t) for text in got for t in re.findall(r"tag(\d\d)x", text)} == {i}
        assert stored(svc, sid).task_id == f"g{i % 4}"


async def test_calls_to_other_hosts_are_untouched(svc: Gateway, model_dir: str) -> None:
    other = fake_gateway(model_dir, max_staleness=None)
    try:
        theirs = other.start_session()
        async with AgentSession(svc.url, ADMIN) as s:
            client = openai.AsyncOpenAI(base_url=other.url + "/v1", api_key=theirs["api_key"],
                                        max_retries=0, timeout=SDK_TIMEOUT)
            await client.chat.completions.create(**chat_body("to the other gateway"))
            await client.close()
        assert texts(svc, s.session_id) == []
        [text] = texts(other, theirs["session_id"])
        assert "to the other gateway" in text
    finally:
        other.thread.stop()


async def test_an_exception_aborts_the_session_and_propagates(svc: Gateway) -> None:
    with pytest.raises(ValueError, match="agent broke"):
        async with AgentSession(svc.url, ADMIN) as s:
            await call_async("openai_async", svc.url, "one call, then a crash")
            s.set_reward(1.0)  # a reward was set, yet a crashed episode is not trained
            raise ValueError("agent broke")
    assert stored(svc, s.session_id).state == SessionState.ABORTED
    with pytest.raises(RuntimeError), AgentSession(svc.url, ADMIN) as s2:
        raise RuntimeError("sync agent broke")
    assert stored(svc, s2.session_id).state == SessionState.ABORTED


async def test_a_cancelled_episode_is_aborted(svc: Gateway) -> None:
    started = asyncio.Event()
    ids: list[str] = []

    async def episode() -> None:
        async with AgentSession(svc.url, ADMIN) as s:
            ids.append(s.session_id)
            started.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(episode())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stored(svc, ids[0]).state == SessionState.ABORTED


async def test_exit_finalizes_with_the_reward_set(svc: Gateway) -> None:
    async with AgentSession(svc.url, ADMIN) as s:
        await call_async("httpx_async", svc.url, "q")
        await s.set_reward(0.75)
    session = stored(svc, s.session_id)
    assert session.state == SessionState.ENDED and session.final_reward == 0.75
    rows = svc.export(s.session_id, credit="outcome")
    assert rows[0]["reward"] == pytest.approx(0.75)


async def test_finalize_is_idempotent_and_the_first_reward_stands(svc: Gateway) -> None:
    async with AgentSession(svc.url, ADMIN) as s:
        await call_async("aiohttp", svc.url, "q")
        async with aiohttp.ClientSession(base_url=svc.url) as c:
            first = await (await c.post("/rl/v1/finalize", json={"final_reward": 1.0})).json()
            again = await (await c.post("/rl/v1/finalize", json={"final_reward": 0.0})).json()
        assert first["already_finalized"] is False and again["already_finalized"] is True
        assert again["final_reward"] == 1.0
        assert (await s.finalize(0.5))["already_finalized"] is True
    session = stored(svc, s.session_id)
    assert session.final_reward == 1.0 and session.state == SessionState.ENDED
    assert len(svc.export(s.session_id)) == 1
    # the trainer takes it (export + ack: the store forgets it); a late finalize is still a no-op
    with svc.admin() as c:
        c.post("/rl/ack_export", json={"session_id": s.session_id}).raise_for_status()
    r = httpx.post(svc.url + "/rl/v1/finalize", json={"final_reward": 0.0},
                   headers={"authorization": f"Bearer {s.api_key}"})
    assert r.status_code == 200 and r.json()["state"] == "exported"
    assert r.json()["final_reward"] == 1.0


async def test_start_waits_on_429_retry_after_and_gives_up_when_bounded(model_dir: str) -> None:
    g = fake_gateway(model_dir, max_staleness=0, batch_size=1)  # one episode per version
    try:
        held = g.start_session()
        r = httpx.post(g.url + "/rl/v1/start_session", json={}, headers=admin_headers())
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"

        t0 = time.monotonic()
        with pytest.raises(CapacityExhausted, match="refused new sessions"):
            async with AgentSession(g.url, ADMIN, start_wait_s=0.5):
                pass
        assert time.monotonic() - t0 < 0.5  # a wait past the bound is not even begun

        async def free_the_slot() -> None:
            await asyncio.sleep(0.3)
            await asyncio.to_thread(httpx.post, g.url + "/rl/abort_session",
                                    json={"session_id": held["session_id"]},
                                    headers=admin_headers())

        freer = asyncio.create_task(free_the_slot())
        t0 = time.monotonic()
        async with AgentSession(g.url, ADMIN, start_wait_s=10) as s:
            waited = time.monotonic() - t0
        await freer
        assert s.start_waits >= 1 and waited >= 0.9  # it honoured Retry-After: 1
        assert stored(g, s.session_id).state == SessionState.ENDED
    finally:
        g.thread.stop()


def test_base_url_and_key_reach_the_session_from_outside_the_context(svc: Gateway) -> None:
    with AgentSession(svc.url, ADMIN) as s:
        assert s.api_key in s.base_url and s.session_id not in s.base_url
        assert s.env() == {"OPENAI_BASE_URL": s.base_url, "OPENAI_API_KEY": s.api_key}
        errors: list[BaseException] = []

        def elsewhere() -> None:  # a bare thread starts with an empty context: no binding
            try:
                openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=SDK_TIMEOUT) \
                    .chat.completions.create(**chat_body("by path"))
                anthropic.Anthropic(base_url=svc.url, api_key=s.api_key, max_retries=0, timeout=SDK_TIMEOUT) \
                    .messages.create(model="m", max_tokens=8,
                                     messages=[{"role": "user", "content": "by key"}])
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=elsewhere)
        t.start()
        t.join(60)
        assert not errors
    got = texts(svc, s.session_id)
    assert len(got) == 2 and "by path" in got[0] and "by key" in got[1]


async def test_nested_sessions_bind_the_innermost_and_restore_the_outer(svc: Gateway) -> None:
    async with AgentSession(svc.url, ADMIN) as outer:
        await call_async("httpx_async", svc.url, "outer one")
        async with AgentSession(svc.url, ADMIN) as inner:
            await call_async("httpx_async", svc.url, "inner")
        await call_async("httpx_async", svc.url, "outer two")
    assert [("outer" in t) for t in texts(svc, outer.session_id)] == [True, True]
    [inner_text] = texts(svc, inner.session_id)
    assert "inner" in inner_text


async def test_a_session_is_entered_once(svc: Gateway) -> None:
    s = AgentSession(svc.url, ADMIN)
    async with s:
        pass
    with pytest.raises(SessionClosed, match="entered once"):
        async with s:
            pass


async def test_service_url_and_key_come_from_the_environment(svc: Gateway,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELAYRL_URL", raising=False)
    monkeypatch.delenv("RELAYRL_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", svc.url + "/v1")
    monkeypatch.setenv("OPENAI_API_KEY", ADMIN)
    async with AgentSession() as s:
        assert s.root_url == svc.url
    # RELAYRL_URL wins, and OPENAI_API_KEY is then not sent to it (it may belong elsewhere)
    monkeypatch.setenv("RELAYRL_URL", svc.url)
    with pytest.raises(Exception, match="admin key"):
        async with AgentSession():
            pass
    monkeypatch.setenv("RELAYRL_API_KEY", ADMIN)
    async with AgentSession(group_id="env") as s2:
        pass
    assert stored(svc, s2.session_id).task_id == "env"


@pytest.mark.slow
async def test_agent_session_records_real_model_tokens(real_gw: Gateway) -> None:
    async with AgentSession(real_gw.url, ADMIN) as s:
        client = openai.AsyncOpenAI(base_url=real_gw.url + "/v1", api_key=NOT_A_KEY,
                                    max_retries=0, timeout=SDK_TIMEOUT)
        r = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8,
            temperature=0)
        await client.close()
        s.set_reward(1.0)
    rows = real_gw.export(s.session_id, style="individual", credit="outcome")
    assert len(rows) == 1
    assert sum(rows[0]["loss_mask"]) == r.usage.completion_tokens
    assert "Name a fruit." in real_gw.deps.renderer.decode(rows[0]["input_ids"])
    assert rows[0]["reward"] == pytest.approx(1.0)
