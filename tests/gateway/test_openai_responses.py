"""OpenAI Responses through the real `openai` SDK (plain, streamed, function calls)."""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI

from tests.gateway.conftest import Gateway
from tests.gateway.test_openai_chat import call

ADD = {"type": "function", "name": "add", "description": "Add two numbers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                       "b": {"type": "number"}},
                      "required": ["a", "b"]}}


def client_for(gw: Gateway, session: dict) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=session["api_key"], max_retries=0)


def test_a_text_response_has_output_text_and_usage(gw: Gateway) -> None:
    gw.script.replies.append("Paris is the capital of France.")
    s = gw.start_session()
    r = client_for(gw, s).responses.create(model="m", instructions="Be brief.",
                                           input="Capital of France?")
    assert r.output_text == "Paris is the capital of France."
    assert r.status == "completed"
    assert r.usage.input_tokens == len(gw.script.requests[0].prompt_ids)


def test_streamed_response_events_build_the_same_text(gw: Gateway) -> None:
    text = "Streaming works one token at a time."
    gw.script.replies.append(text)
    gw.deps.engine.token_delay_s = 0.002  # sampled at an engine's pace, not all ready at once
    s = gw.start_session()
    deltas, final = [], None
    with client_for(gw, s).responses.stream(model="m", input="go") as stream:
        for ev in stream:
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == text
    assert len(deltas) > 3
    assert final.output_text == text


def test_function_calls_round_trip_through_function_call_output(gw: Gateway) -> None:
    gw.script.replies += [call("add", a=2, b=3), "It is 5."]
    s = gw.start_session()
    client = client_for(gw, s)
    r1 = client.responses.create(model="m", input="2+3?", tools=[ADD])
    fc = [o for o in r1.output if o.type == "function_call"]
    assert fc and fc[0].name == "add" and json.loads(fc[0].arguments) == {"a": 2, "b": 3}
    follow = [{"role": "user", "content": "2+3?"}, fc[0].model_dump(),
              {"type": "function_call_output", "call_id": fc[0].call_id, "output": "5"}]
    r2 = client.responses.create(model="m", input=follow, tools=[ADD])
    assert r2.output_text == "It is 5."
    rows = gw.export(s["session_id"], style="concat")
    assert len(rows) == 1  # the second call extended the first one's tokens


def test_previous_response_id_is_refused_clearly(gw: Gateway) -> None:
    s = gw.start_session()
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client_for(gw, s).responses.create(model="m", input="x", previous_response_id="resp_1")
