"""A client that leaves before its answer: the generation stops and the call is noted as aborted
(never recorded as a finished call with a cut reply), for all three wires, streamed or not; the
durable log recovers it; the agent's next call works and exports as if the cut call never was."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator

import anthropic
import httpx
import openai
import pytest

from relayrl.engine.fake import FakeEngine
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.trajectory import InteractionLog, Session, export_session
from relayrl.types import GenerateRequest, TokenChunk
from tests.gateway.conftest import ADMIN, Gateway

LONG_REPLY = " ".join(f"word{i}" for i in range(400))
"""About 1,200 tokens: at 5 ms a token the first reply is far from done when the client leaves."""


class Counted:
    """Wraps a FakeEngine's `stream` to count the tokens it hands out."""

    def __init__(self, engine: FakeEngine) -> None:
        self.tokens = 0
        self._stream = engine.stream
        engine.stream = self  # type: ignore[method-assign]

    def __call__(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        inner = self._stream(request)

        async def gen() -> AsyncIterator[TokenChunk]:
            async for chunk in inner:
                self.tokens += len(chunk.ids)
                yield chunk

        return gen()


@pytest.fixture
def slow_gw(model_dir: str, tmp_path) -> Iterator[tuple[Gateway, Counted]]:
    """A fake-engine gateway (with a durable log) whose replies take seconds to sample."""
    replies: list[str] = []
    engine = FakeEngine(lambda r: replies.pop(0) if replies else LONG_REPLY,
                        tokenizer_path=model_dir, token_delay_s=0.005)
    counted = Counted(engine)
    cfg = GatewayConfig(model=model_dir, engine="fake", admin_key=ADMIN,
                        log_path=str(tmp_path / "log.db"), model_label="relayrl-test")
    thread = GatewayThread(build_deps(cfg, engine=engine)).start()
    g = Gateway(thread.url, thread)
    g.replies = replies  # type: ignore[attr-defined]
    yield g, counted
    thread.stop()


def _wait(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def _leave_mid_stream(api: str, url: str, key: str) -> int:
    """Open a streamed call with the real SDK, read a few events, hang up; events read."""
    read = 0
    if api == "anthropic":
        client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
        stream = client.messages.create(model="m", max_tokens=2000, stream=True,
                                        messages=[{"role": "user", "content": "count"}])
    else:
        oc = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        if api == "chat":
            stream = oc.chat.completions.create(model="m", stream=True, max_tokens=2000,
                                                messages=[{"role": "user", "content": "count"}])
        else:
            stream = oc.responses.create(model="m", stream=True, max_output_tokens=2000,
                                         input="count")
    for _ in stream:
        read += 1
        if read == 5:
            break
    stream.close()  # the SDK closes the HTTP response: the connection goes away
    return read


def _session(gw: Gateway, sid: str) -> Session:
    return gw.deps.store.get(sid, touch=False)


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
def test_leaving_mid_stream_stops_the_engine_and_records_an_aborted_call(
        slow_gw: tuple[Gateway, Counted], api: str) -> None:
    gw, counted = slow_gw
    s = gw.start_session(task_id="t")
    assert _leave_mid_stream(api, gw.url, s["api_key"]) == 5
    session = _session(gw, s["session_id"])
    _wait(lambda: len(session.aborted_calls) == 1)
    # not a finished call with a cut reply: nothing in the tree, no row
    assert session.interactions == ()
    cut = session.aborted_calls[0]
    assert cut.reason == "client_disconnected" and cut.parent_id is None
    assert cut.output_tokens is not None and 0 < cut.output_tokens < 1000
    # the engine stopped: nothing more is sampled after the hang-up
    sampled = counted.tokens
    time.sleep(0.3)
    assert counted.tokens == sampled < 1000
    assert counted.tokens <= cut.output_tokens + 64  # at most what was in flight

    # the agent retries the same prompt: it is served and recorded as the session's first call
    gw.replies.append("done")  # type: ignore[attr-defined]
    oc = openai.OpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    r = oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "count"}])
    assert r.choices[0].message.content == "done"
    [call] = session.interactions
    assert r.id == "chatcmpl-" + call.id and call.id != cut.id
    assert call.branch_reason == "first"
    httpx.post(gw.url + "/rl/end_session",
               headers={"authorization": f"Bearer {s['api_key']}"}).raise_for_status()
    rows = gw.export(s["session_id"])
    assert len(rows) == 1 and rows[0]["interaction_ids"] == [call.id]
    assert rows[0]["metadata"]["aborted_calls"] == 1
    assert sum(rows[0]["loss_mask"]) == len(session.interactions[0].output_ids)


@pytest.mark.parametrize("api", ["chat", "anthropic"])
def test_leaving_before_a_non_streamed_answer_records_an_aborted_call(
        slow_gw: tuple[Gateway, Counted], api: str) -> None:
    gw, counted = slow_gw
    s = gw.start_session()
    if api == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
    else:
        path, body = "/v1/messages", {"max_tokens": 2000,
                                      "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(gw.url + path, json={"model": "m", **body}, timeout=0.5,
                   headers={"authorization": f"Bearer {s['api_key']}",
                            "x-api-key": s["api_key"]})
    session = _session(gw, s["session_id"])
    _wait(lambda: len(session.aborted_calls) == 1)
    assert session.interactions == ()
    assert session.aborted_calls[0].output_tokens is None  # not counted without a stream
    sampled = counted.tokens
    time.sleep(0.3)
    assert counted.tokens == sampled < 1000


def test_durable_log_recovers_the_aborted_call_and_keeps_finished_ones(
        slow_gw: tuple[Gateway, Counted], tmp_path) -> None:
    gw, _ = slow_gw
    s = gw.start_session()
    gw.replies.append("first answer")  # type: ignore[attr-defined]
    oc = openai.OpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    first = oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
    # the second turn extends the first; its client leaves mid-stream
    second_turn = [{"role": "user", "content": "a"},
                   {"role": "assistant", "content": "first answer"},
                   {"role": "user", "content": "b"}]
    stream = oc.chat.completions.create(model="m", stream=True, messages=second_turn)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    session = _session(gw, s["session_id"])
    _wait(lambda: len(session.aborted_calls) == 1)
    first_id = first.id.removeprefix("chatcmpl-")
    assert session.aborted_calls[0].parent_id == first_id
    # the agent retries that turn: it extends the first call, in the same segment
    gw.replies.append("second answer")  # type: ignore[attr-defined]
    retry = oc.chat.completions.create(model="m", messages=second_turn)
    second_id = retry.id.removeprefix("chatcmpl-")
    second = session.get(second_id)
    assert second.parent_id == first_id and second.prompt_source == "extend"
    gw.thread.stop()
    with InteractionLog(tmp_path / "log.db") as log:
        [back] = log.recover()
    assert log.skipped == 0
    assert [c.id for c in back.interactions] == [first_id, second_id]
    assert [c.to_dict() for c in back.interactions] == [c.to_dict() for c in session.interactions]
    assert back.aborted_calls == session.aborted_calls
    assert back.stats().aborted_calls == 1
    back.end()
    rows = export_session(back)  # one concat row: the cut call is in none
    assert [r.interaction_ids for r in rows] == [[first_id, second_id]]
    assert rows[0].metadata["aborted_calls"] == 1


def test_a_recorded_id_cannot_be_noted_aborted_too(model_dir: str) -> None:
    from relayrl.errors import InvalidRequest, SessionClosed
    from relayrl.trajectory import AbortedCall

    s = Session("s1")
    s.record_aborted(AbortedCall("c1", "s1", None, 3, 2, "client_disconnected"))
    with pytest.raises(InvalidRequest):
        s.record_aborted(AbortedCall("c1", "s1", None, 3, 2, "client_disconnected"))
    s.end()
    s.mark_exported()
    with pytest.raises(SessionClosed):  # a closed session keeps what it had
        s.record_aborted(AbortedCall("c2", "s1", None, 3, 2, "client_disconnected"))
    assert len(s.aborted_calls) == 1


@pytest.mark.slow
def test_real_model_stream_cut_stops_generation(real_gw: Gateway) -> None:
    s = real_gw.start_session()
    engine = real_gw.deps.engine
    oc = openai.OpenAI(base_url=real_gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    stream = oc.chat.completions.create(
        model="m", stream=True, max_tokens=400, temperature=1.0,
        messages=[{"role": "user", "content": "Write a long story about a lighthouse."}])
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    session = _session(real_gw, s["session_id"])
    _wait(lambda: len(session.aborted_calls) == 1, timeout_s=30)
    _wait(lambda: engine.active == 0, timeout_s=10)  # the sequence left the running batch
    assert session.interactions == ()
    assert 0 < session.aborted_calls[0].output_tokens < 400  # type: ignore[operator]
