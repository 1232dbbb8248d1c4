"""Retries with an `Idempotency-Key`: the recorded answer comes back (a stream as a stream), the
session records one call, keys are per session, a changed body is a 422, a retry waits for the
first call, and key values never reach the logs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.idempotency import IdempotencyCache
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.trajectory import Session
from tests.gateway.conftest import ADMIN, Gateway

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture
def counting_gw(model_dir: str) -> Iterator[Gateway]:
    """A fake gateway whose every generation gets a fresh reply text (so a replay is visible)."""
    n = [0]

    def script(_request) -> str:
        n[0] += 1
        return f"reply number {n[0]}"

    engine = FakeEngine(script, tokenizer_path=model_dir, token_delay_s=0.002)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN,
                        model_label="relayrl-test")
    thread = GatewayThread(build_deps(cfg, engine=engine)).start()
    yield Gateway(thread.url, thread)
    thread.stop()


def _session(gw: Gateway, sid: str) -> Session:
    return gw.deps.store.get(sid, touch=False)


def test_chat_retry_gets_the_recorded_answer_and_one_call(counting_gw: Gateway,
                                                           caplog) -> None:
    caplog.set_level(logging.DEBUG)
    gw = counting_gw
    s = gw.start_session()
    oc = openai.OpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    key = "idem-secret-value-4711"
    first = oc.chat.completions.create(model="m", messages=MSG, logprobs=True,
                                       extra_headers={"Idempotency-Key": key})
    again = oc.chat.completions.create(model="m", messages=MSG, logprobs=True,
                                       extra_headers={"Idempotency-Key": key})
    assert again.model_dump() == first.model_dump()  # same id, content, logprobs, created
    assert first.choices[0].message.content == "reply number 1"
    session = _session(gw, s["session_id"])
    assert len(session.interactions) == 1
    # a new key is a new call
    third = oc.chat.completions.create(model="m", messages=MSG,
                                       extra_headers={"Idempotency-Key": "another"})
    assert third.choices[0].message.content == "reply number 2"
    assert len(session.interactions) == 2
    assert key not in caplog.text


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
def test_stream_retry_replays_the_recorded_answer_as_a_stream(counting_gw: Gateway,
                                                               api: str) -> None:
    gw = counting_gw
    s = gw.start_session()
    headers = {"Idempotency-Key": f"k-{api}"}

    def run() -> tuple[str, str]:
        if api == "anthropic":
            ac = anthropic.Anthropic(base_url=gw.url, api_key=s["api_key"], max_retries=0)
            with ac.messages.stream(model="m", max_tokens=50, messages=MSG,
                                    extra_headers=headers) as st:
                msg = st.get_final_message()
            return msg.id, "".join(b.text for b in msg.content if b.type == "text")
        oc = openai.OpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0)
        if api == "chat":
            chunks = list(oc.chat.completions.create(model="m", messages=MSG, stream=True,
                                                     extra_headers=headers))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert {c.id for c in chunks} == {chunks[0].id}
            assert chunks[-1].choices[0].finish_reason == "stop"
            return chunks[0].id, text
        events = list(oc.responses.create(model="m", input="hello", stream=True,
                                          extra_headers=headers))
        done = [e for e in events if e.type == "response.completed"]
        assert len(done) == 1
        return done[0].response.id, done[0].response.output_text

    first = run()
    again = run()
    assert first == again
    assert first[1] == "reply number 1"
    assert len(_session(gw, s["session_id"]).interactions) == 1


def test_keys_are_scoped_per_session(counting_gw: Gateway) -> None:
    gw = counting_gw
    a, b = gw.start_session(), gw.start_session()
    h = {"Idempotency-Key": "shared-key"}
    ra = openai.OpenAI(base_url=gw.url + "/v1", api_key=a["api_key"], max_retries=0)
    rb = openai.OpenAI(base_url=gw.url + "/v1", api_key=b["api_key"], max_retries=0)
    one = ra.chat.completions.create(model="m", messages=MSG, extra_headers=h)
    two = rb.chat.completions.create(model="m", messages=MSG, extra_headers=h)
    assert one.id != two.id
    assert two.choices[0].message.content == "reply number 2"  # not a's answer
    assert len(_session(gw, a["session_id"]).interactions) == 1
    assert len(_session(gw, b["session_id"]).interactions) == 1


@pytest.mark.parametrize("path,body,shape", [
    ("/v1/chat/completions", {"messages": MSG}, "openai"),
    ("/v1/messages", {"max_tokens": 20, "messages": MSG}, "anthropic"),
])
def test_same_key_other_body_is_422_in_the_wire_shape(counting_gw: Gateway, path: str,
                                                      body: dict, shape: str) -> None:
    gw = counting_gw
    s = gw.start_session()
    h = {"authorization": f"Bearer {s['api_key']}", "x-api-key": s["api_key"],
         "idempotency-key": "k1"}
    assert httpx.post(gw.url + path, json={"model": "m", **body}, headers=h).status_code == 200
    other = {**body, "temperature": 0.5}
    r = httpx.post(gw.url + path, json={"model": "m", **other}, headers=h)
    assert r.status_code == 422
    if shape == "openai":
        assert r.json()["error"]["type"] == "invalid_request_error"
    else:
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
    bad = httpx.post(gw.url + path, json={"model": "m", **body},
                     headers={**h, "idempotency-key": "x" * 300})
    assert bad.status_code == 400
    assert len(_session(gw, s["session_id"]).interactions) == 1


def test_a_retry_while_the_first_runs_waits_for_it(model_dir: str) -> None:
    engine = FakeEngine(lambda r: " ".join(["slow"] * 60), tokenizer_path=model_dir,
                        token_delay_s=0.01)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN,
                        model_label="relayrl-test")
    thread = GatewayThread(build_deps(cfg, engine=engine)).start()
    try:
        gw = Gateway(thread.url, thread)
        s = gw.start_session()
        h = {"authorization": f"Bearer {s['api_key']}", "idempotency-key": "k"}
        body = {"model": "m", "messages": MSG}
        results: list[httpx.Response] = []

        def call() -> None:
            results.append(httpx.post(gw.url + "/v1/chat/completions", json=body, headers=h,
                                      timeout=30))

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.1)  # the second arrives while the first is generating
        for t in threads:
            t.join(30)
        assert [r.status_code for r in results] == [200, 200]
        assert results[0].json() == results[1].json()
        assert len(engine.requests) == 1  # sampled once
        assert len(_session(gw, s["session_id"]).interactions) == 1
    finally:
        thread.stop()


def test_a_retry_after_the_first_client_left_runs_afresh(counting_gw: Gateway) -> None:
    gw = counting_gw
    s = gw.start_session()
    h = {"authorization": f"Bearer {s['api_key']}", "idempotency-key": "k"}
    body = {"model": "m", "messages": MSG, "stream": True}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=h) as r:
        for _ in r.iter_lines():
            break  # the client leaves after the first event
    session = _session(gw, s["session_id"])
    deadline = time.monotonic() + 10
    while not session.aborted_calls and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(session.aborted_calls) == 1
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=h) as r:
        assert r.status_code == 200
        assert "[DONE]" in "".join(r.iter_lines())
    [call] = session.interactions  # the cut call left no answer to replay: generated again
    assert call.reply.content == "reply number 2"
    assert call.id != session.aborted_calls[0].id


@pytest.mark.asyncio
async def test_cache_is_bounded_and_dies_with_the_session() -> None:
    from relayrl.chat.completion import Completion
    from relayrl.gateway.idempotency import Answer

    cache = IdempotencyCache(max_entries=4)
    sessions = [Session(f"s{i}") for i in range(6)]
    for s in sessions:
        slot = await cache.claim(s, "k", b"f")
        cache.fulfil(slot, Answer(Completion("id", "m", 0, (), 1)))
    assert len(cache) == 4
    sessions[5].abort()
    slot = await cache.claim(sessions[0], "k2", b"f")  # insert sweeps closed sessions' answers
    assert len(cache) <= 4
    again = await cache.claim(sessions[4], "k", b"f")
    assert isinstance(again, Answer)
    fresh = await cache.claim(sessions[0], "k", b"f")  # evicted: runs afresh
    assert not isinstance(fresh, Answer)


@pytest.mark.slow
def test_real_model_stream_retry_is_replayed_not_resampled(real_gw: Gateway) -> None:
    s = real_gw.start_session()
    oc = openai.OpenAI(base_url=real_gw.url + "/v1", api_key=s["api_key"], max_retries=0)

    def run(key: str) -> tuple[str, str]:
        chunks = list(oc.chat.completions.create(
            model="m", stream=True, max_tokens=12, temperature=1.0,
            messages=[{"role": "user", "content": "Name a random animal."}],
            extra_headers={"Idempotency-Key": key}))
        return chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks
                                     if c.choices)

    first = run("real-1")
    assert run("real-1") == first
    session = _session(real_gw, s["session_id"])
    assert len(session.interactions) == 1
    assert session.interactions[0].reply.content == first[1]
