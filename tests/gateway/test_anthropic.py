"""Anthropic Messages through the real `anthropic` SDK (plain, streamed, tools, errors)."""

from __future__ import annotations

import anthropic
import pytest

from tests.gateway.conftest import Gateway
from tests.gateway.test_openai_chat import call

ADD = {"name": "add", "description": "Add two numbers.",
       "input_schema": {"type": "object", "properties": {"a": {"type": "number"},
                                                         "b": {"type": "number"}},
                        "required": ["a", "b"]}}


def client_for(gw: Gateway, session: dict) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=session["api_key"], max_retries=0)


def test_a_message_comes_back_with_text_and_usage(gw: Gateway) -> None:
    gw.script.replies.append("Bonjour!")
    s = gw.start_session()
    m = client_for(gw, s).messages.create(model="m", max_tokens=64, system="Be French.",
                                          messages=[{"role": "user", "content": "hello"}])
    assert m.content[0].type == "text" and m.content[0].text == "Bonjour!"
    assert m.stop_reason == "end_turn"
    assert m.usage.input_tokens == len(gw.script.requests[0].prompt_ids)


def test_streaming_text_arrives_in_pieces(gw: Gateway) -> None:
    text = "A streamed answer with several tokens in it."
    gw.script.replies.append(text)
    gw.deps.engine.token_delay_s = 0.002  # sampled at an engine's pace, not all ready at once
    s = gw.start_session()
    with client_for(gw, s).messages.stream(
            model="m", max_tokens=64, messages=[{"role": "user", "content": "go"}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text
    assert len(pieces) > 3
    assert final.content[0].text == text


def test_tool_use_and_tool_result_continue_one_segment(gw: Gateway) -> None:
    gw.script.replies += [call("add", a=1, b=6), "That makes 7."]
    s = gw.start_session()
    client = client_for(gw, s)
    msgs = [{"role": "user", "content": "1+6?"}]
    m1 = client.messages.create(model="m", max_tokens=64, tools=[ADD], messages=msgs)
    assert m1.stop_reason == "tool_use"
    use = next(b for b in m1.content if b.type == "tool_use")
    assert use.name == "add" and use.input == {"a": 1, "b": 6}
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in m1.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "7"}]}]
    m2 = client.messages.create(model="m", max_tokens=64, tools=[ADD], messages=msgs)
    assert m2.content[0].text == "That makes 7."
    assert len(gw.export(s["session_id"], style="concat")) == 1


def test_streamed_tool_use_has_its_input_json(gw: Gateway) -> None:
    gw.script.replies.append(call("add", a=4, b=4))
    s = gw.start_session()
    with client_for(gw, s).messages.stream(model="m", max_tokens=64, tools=[ADD],
                                           messages=[{"role": "user", "content": "4+4"}]) as st:
        final = st.get_final_message()
    use = next(b for b in final.content if b.type == "tool_use")
    assert use.input == {"a": 4, "b": 4}
    assert final.stop_reason == "tool_use"


def test_errors_use_anthropic_shapes(gw: Gateway) -> None:
    s = gw.start_session()
    client = client_for(gw, s)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", messages=[{"role": "user", "content": "x"}],
                               max_tokens=0)
    assert e.value.response.json()["type"] == "error"
    assert e.value.response.json()["error"]["type"] == "invalid_request_error"
    bad = anthropic.Anthropic(base_url=gw.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e2:
        bad.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert e2.value.response.json()["error"]["type"] == "authentication_error"
