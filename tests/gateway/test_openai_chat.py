"""OpenAI Chat Completions through the real `openai` SDK against a gateway on loopback."""

from __future__ import annotations

import json

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.gateway.conftest import Gateway

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                        "b": {"type": "number"}},
                       "required": ["a", "b"]},
    },
}
MUL_TOOL = {**ADD_TOOL, "function": {**ADD_TOOL["function"], "name": "multiply",
                                     "description": "Multiply two numbers."}}


def call(name: str, **args: float) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def client_for(gw: Gateway, session: dict) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=session["api_key"], max_retries=0)


def test_sync_client_gets_the_scripted_reply_and_the_call_is_recorded(gw: Gateway) -> None:
    gw.script.replies.append("Hello there!")
    s = gw.start_session(task_id="t1")
    r = client_for(gw, s).chat.completions.create(
        model="relayrl-test", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == "Hello there!"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0
    assert r.usage.prompt_tokens == len(gw.script.requests[0].prompt_ids)
    rows = gw.export(s["session_id"])
    assert len(rows) == 1
    assert rows[0]["input_ids"][: r.usage.prompt_tokens] == list(gw.script.requests[0].prompt_ids)


async def test_async_client_and_streaming_deliver_the_same_text(gw: Gateway) -> None:
    text = "The answer is forty-two, as everyone knows."
    gw.script.replies += [text, text]
    gw.deps.engine.token_delay_s = 0.002  # sampled at an engine's pace, not all ready at once
    s = gw.start_session()
    client = AsyncOpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    plain = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "q"}])
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "q2"}], stream=True,
        stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert plain.choices[0].message.content == text
    assert "".join(pieces) == text
    assert sum(1 for p in pieces if p) > 3  # streamed in pieces, not one lump
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens > 0
    await client.close()


def test_a_tool_call_is_parsed_and_the_follow_up_extends_the_same_segment(gw: Gateway) -> None:
    gw.script.replies += [call("add", a=3, b=4), "3 + 4 = 7."]
    s = gw.start_session()
    client = client_for(gw, s)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    r1 = client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
    msg = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].function.name == "add"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"a": 3, "b": 4}
    # the agent echoes the server's own message back, nulls included
    messages += [msg.model_dump(), {"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                                    "content": "7"}]
    r2 = client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
    assert r2.choices[0].message.content == "3 + 4 = 7."
    first, second = gw.script.requests
    engine_first = list(first.prompt_ids)
    # the second prompt starts with the first prompt and everything the engine sampled
    rows = gw.export(s["session_id"], style="concat")
    assert len(rows) == 1
    ids = rows[0]["input_ids"]
    assert list(second.prompt_ids) == ids[: len(second.prompt_ids)]
    assert ids[: len(engine_first)] == engine_first


def test_parallel_tool_calls_come_back_as_two_calls(gw: Gateway) -> None:
    gw.script.replies.append(call("add", a=1, b=2) + "\n" + call("multiply", a=3, b=4))
    s = gw.start_session()
    r = client_for(gw, s).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "both"}], tools=[ADD_TOOL, MUL_TOOL])
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["add", "multiply"]
    assert len({c.id for c in calls}) == 2


def test_streamed_tool_calls_arrive_as_deltas(gw: Gateway) -> None:
    gw.script.replies.append("Let me add. " + call("add", a=2, b=5))
    s = gw.start_session()
    stream = client_for(gw, s).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2+5"}], tools=[ADD_TOOL], stream=True)
    content, names, args, finish = "", [], "", None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                args += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    assert content.strip() == "Let me add."
    assert names == ["add"]
    assert json.loads(args) == {"a": 2, "b": 5}
    assert finish == "tool_calls"


def test_logprobs_n_seed_and_stop_are_honoured(gw: Gateway) -> None:
    gw.script.replies += ["alpha beta STOP gamma", "one two"]
    s = gw.start_session()
    client = client_for(gw, s)
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], stop=["STOP"], logprobs=True,
        top_logprobs=0, seed=7)
    assert r.choices[0].message.content.strip() == "alpha beta"
    lp = r.choices[0].logprobs.content
    assert lp and all(t.logprob <= 0 for t in lp)
    assert gw.script.requests[0].params.seed == 7
    r2 = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}],
                                        n=2)
    assert [c.index for c in r2.choices] == [0, 1]


def test_tokens_ready_together_go_out_in_one_event_with_their_logprobs(gw: Gateway) -> None:
    # the fake engine hands over its whole reply before the route runs: one content event, not
    # one per token, carrying every token's logprob, the same as the plain answer
    text = "Tokens that are ready together are sent together, in order."
    gw.script.replies += [text, text]
    s = gw.start_session()
    client = client_for(gw, s)
    plain = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}],
                                           logprobs=True)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "b"}], logprobs=True, stream=True,
        stream_options={"include_usage": True})
    contents, lps, usage = [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.delta.content:
                contents.append(c.delta.content)
            if c.logprobs and c.logprobs.content:
                lps += c.logprobs.content
    assert contents == [text]
    assert usage is not None
    want = [(t.token, t.logprob) for t in plain.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in lps] == want
    assert len(lps) == usage.completion_tokens  # one per sampled token
    rows = gw.export(s["session_id"], style="individual")  # both recorded, token for token
    sampled = [[t for t, m in zip(r["input_ids"], r["loss_mask"], strict=True) if m]
               for r in rows]
    assert len(rows) == 2 and sampled[0] == sampled[1] and len(sampled[1]) == len(lps)


def test_tool_choice_naming_a_function_forces_that_call(gw: Gateway) -> None:
    # the model is made to start the call in the prompt; it only writes the arguments
    gw.script.replies.append('{"a": 1, "b": 1}}\n</tool_call>')
    s = gw.start_session()
    r = client_for(gw, s).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], tools=[ADD_TOOL, MUL_TOOL],
        tool_choice={"type": "function", "function": {"name": "multiply"}})
    tc = r.choices[0].message.tool_calls
    assert tc and tc[0].function.name == "multiply"
    assert json.loads(tc[0].function.arguments) == {"a": 1, "b": 1}


@pytest.mark.parametrize(
    ("kwargs", "status", "fragment"),
    [
        ({"messages": "not a list"}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, 400,
         "presence_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 99}, 400, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                      "image_url": {"url": "data:,"}}]}]},
         400, "image"),
    ],
)
def test_bad_requests_get_openai_errors_not_500s(gw: Gateway, kwargs: dict, status: int,
                                                 fragment: str) -> None:
    s = gw.start_session()
    client = client_for(gw, s)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="m", **kwargs)
    assert e.value.status_code == status
    body = e.value.response.json()
    assert body["error"]["type"] == "invalid_request_error"
    assert fragment in body["error"]["message"]
    assert "Traceback" not in e.value.response.text


def test_a_prompt_longer_than_the_context_is_a_400(model_dir: str) -> None:
    from tests.gateway.conftest import fake_gateway

    g = fake_gateway(model_dir, context_length=64)
    try:
        s = g.start_session()
        with pytest.raises(openai.BadRequestError, match="context"):
            client_for(g, s).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "word " * 200}])
    finally:
        g.thread.stop()


def test_malformed_json_and_unknown_routes_are_client_errors(gw: Gateway) -> None:
    import httpx

    s = gw.start_session()
    h = {"authorization": f"Bearer {s['api_key']}", "content-type": "application/json"}
    r = httpx.post(gw.url + "/v1/chat/completions", content=b"{nope", headers=h)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(gw.url + "/v1/nothing-here", headers=h)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(gw.url + "/v1/chat/completions", content=b"x" * (9 << 20), headers=h)
    assert r.status_code == 413


def test_models_lists_the_policy(gw: Gateway) -> None:
    s = gw.start_session()
    assert [m.id for m in client_for(gw, s).models.list()] == ["relayrl-test"]


@pytest.mark.parametrize("logprobs", [False, True])
def test_an_answer_is_the_bytes_the_stdlib_encoder_writes(gw: Gateway, logprobs: bool) -> None:
    # answers without floats are encoded by orjson: the same bytes as json.dumps with
    # ensure_ascii=False and compact separators, for quotes, escapes, control characters and
    # text outside ASCII; with logprobs (floats) the stdlib encodes them
    import httpx

    gw.script.replies += ['Say "hi" \\ back\ttab\nline é 你好 😀 \u2028 \x01 end',
                          '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "é"}}\n'
                          '</tool_call>']
    s = gw.start_session(task_id="bytes")
    for _ in range(2):
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                       headers={"authorization": f"Bearer {s['api_key']}"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "logprobs": logprobs, "tools": [ADD_TOOL]})
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/json"
        again = json.dumps(json.loads(r.content), ensure_ascii=False, allow_nan=False,
                           separators=(",", ":")).encode()
        assert r.content == again
        assert int(r.headers["content-length"]) == len(r.content)
