"""Responses wire format, checked against the real `openai` SDK.

The SDK talks to our pure converters through an in-memory transport (no server): what it sends is
parsed by `parse_body`/`to_request`; what we render it validates strictly and accumulates with its
own `ResponseStreamState`, which checks item identities and event order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import httpx2
import openai
import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from relayrl.chat import wire_openai_responses as wire
from relayrl.chat.completion import Choice, Completion, CompletionRequest
from relayrl.chat.conversation import (
    ContentDelta,
    Message,
    ParsedReply,
    ReasoningDelta,
    ReplyDelta,
    Tool,
    ToolCall,
    ToolCallDelta,
)
from relayrl.errors import EngineError, InvalidRequest

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
     "strict": False},
    {"type": "function", "name": "get_time", "parameters": {"type": "object"}, "strict": None},
]
REPLY = ParsedReply(
    content="Let me check both.",
    reasoning="The user wants weather and time.",
    tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
                ToolCall("call_2", "get_time", '{"tz": "Europe/Paris"}')),
)
SCRIPT: list[ReplyDelta] = [
    ReasoningDelta("The user wants "), ReasoningDelta("weather and time."),
    ContentDelta("Let me "), ContentDelta("check both."),
    ToolCallDelta(0, '{"city": ', id="call_1", name="get_weather"), ToolCallDelta(0, '"Paris"}'),
    ToolCallDelta(1, '{"tz": "Europe/Paris"}', id="call_2", name="get_time"),
]
USER = [{"role": "user", "content": "Weather and time in Paris?"}]


def parse(body: dict[str, Any]) -> CompletionRequest:
    return wire.to_request(wire.parse_body({"model": "m", **body}))


def completion(req: CompletionRequest, reply: ParsedReply = REPLY,
               finish: str = "tool_calls") -> Completion:
    ch = Choice(index=0, reply=reply, finish_reason=finish,  # type: ignore[arg-type]
                interaction_id="int-0", output_tokens=11)
    return Completion(id="abc123", model=req.model, created=1_700_000_000, choices=(ch,),
                      prompt_tokens=42)


def stream_frames(req: CompletionRequest, script: Sequence[ReplyDelta] = SCRIPT,
                  finish: str = "tool_calls") -> list[str]:
    enc = wire.StreamEncoder.for_request(req, "abc123", 1_700_000_000)
    frames = enc.start(prompt_tokens=42)
    for d in script:
        frames += enc.delta(0, d)
    frames += enc.finish(0, finish, "int-0")  # type: ignore[arg-type]
    return frames + enc.end(42, 11)


def events(frames: list[str]) -> list[Any]:
    """Parse each `event: X\\ndata: {...}` frame; the event name must match the data's type."""
    out = []
    for f in frames:
        head, data = f.removesuffix("\n\n").split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert head[len("event: "):] == payload["type"]
        out.append(EVENTS.validate_python(payload))
    return out


def client_for(handler: Callable[[dict[str, Any]], httpx2.Response]) -> openai.OpenAI:
    transport = httpx2.MockTransport(lambda r: handler(json.loads(r.content)))
    return openai.OpenAI(api_key="k", base_url="http://127.0.0.1/v1", max_retries=0,
                         http_client=httpx2.Client(transport=transport),
                         _strict_response_validation=True)


def fake_gateway(seen: list[CompletionRequest]) -> Callable[[dict[str, Any]], httpx2.Response]:
    def handle(body: dict[str, Any]) -> httpx2.Response:
        req = wire.to_request(wire.parse_body(body))
        seen.append(req)
        if req.stream:
            return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                                   content="".join(stream_frames(req)).encode())
        return httpx2.Response(200, json=wire.render_completion(completion(req), req))
    return handle


# ---------------------------------------------------------------- requests


def test_sdk_request_becomes_conversation() -> None:
    seen: list[CompletionRequest] = []
    client_for(fake_gateway(seen)).responses.create(
        model="policy", instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Need a tool."}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
        ],
        tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},  # type: ignore[arg-type]
        temperature=0.5, top_p=0.8, max_output_tokens=77, reasoning={"effort": "low"},
        store=False, include=["reasoning.encrypted_content"], metadata={"run": "r1"},
    )
    req = seen[0]
    assert req.conversation.messages == (
        Message(role="system", content="Be brief."),
        Message(role="system", content="Use tools."),
        Message(role="user", content="Weather?"),
        Message(role="assistant", content="Checking.", reasoning="Need a tool.",
                tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris"}'),)),
        Message(role="tool", content="18C", tool_call_id="c1", name="get_weather"),
    )
    assert req.conversation.tools[0] == Tool("get_weather", "Weather in a city.",
                                             TOOLS[0]["parameters"])
    assert req.conversation.tool_choice == "get_weather"
    assert req.conversation.template_kwargs == {"reasoning_effort": "low"}
    p = req.params
    assert (p.temperature, p.top_p, p.max_new_tokens) == (0.5, 0.8, 77)
    assert req.metadata["reasoning"] == {"effort": "low"}
    assert req.metadata["metadata"] == {"run": "r1"}


def test_string_input_is_one_user_message() -> None:
    req = parse({"input": "hello"})
    assert req.conversation.messages == (Message(role="user", content="hello"),)
    assert req.params.max_new_tokens > 0 and req.n == 1


def test_reasoning_item_with_only_a_summary_becomes_reasoning() -> None:
    req = parse({"input": [*USER, {"type": "reasoning", "id": "rs", "summary": [
        {"type": "summary_text", "text": "a"}, {"type": "summary_text", "text": "b"}]},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]})
    assert req.conversation.messages[1] == Message(role="assistant", content="ok",
                                                   reasoning="a\nb")


@pytest.mark.parametrize("dump", [
    lambda item: item.model_dump(),
    lambda item: item.model_dump(exclude_none=True),
    lambda item: item.to_dict(),
    lambda item: item.model_dump(exclude_unset=True),
])
def test_echoed_output_items_parse_back_to_the_reply(dump: Callable[[Any], Any]) -> None:
    req = parse({"input": USER, "tools": TOOLS})
    resp = Response.model_validate(wire.render_completion(completion(req), req))
    items = [dump(item) for item in resp.output]
    outputs = [{"type": "function_call_output", "call_id": c.id, "output": "ok"}
               for c in REPLY.tool_calls]
    again = parse({"input": [*USER, *items, *outputs], "tools": TOOLS})
    msgs = again.conversation.messages
    assert msgs[1] == REPLY.to_message()
    assert [(m.role, m.tool_call_id, m.name) for m in msgs[2:]] == [
        ("tool", "call_1", "get_weather"), ("tool", "call_2", "get_time")]


def test_harmless_fields_are_accepted_and_unknown_ones_listed() -> None:
    body = wire.parse_body({"model": "m", "input": "x", "store": True, "truncation": "auto",
                            "service_tier": "auto", "user": "u", "parallel_tool_calls": True,
                            "max_tool_calls": 3, "text": {"format": {"type": "text"},
                                                          "verbosity": "low"},
                            "include": ["reasoning.encrypted_content"], "surprise": 1})
    wire.to_request(body)
    assert body.extra_fields() == ("surprise",)


BAD_REQUESTS = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}}, "text.format"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"tools": [{"type": "teleport"}]}, "tools[0]"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "c"}]}]},
     "tools[0].tools[0]"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                      "tools": [{"type": "function", "name": "nope"}]}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input[0].content[0]"),
    ({"input": [*USER, {"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_file", "file_id": "f"}]}]}, "input[1].content[0]"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_REQUESTS)
def test_unservable_request_is_a_400_naming_the_field(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse({"input": USER, **patch})
    assert info.value.param == param  # type: ignore[attr-defined]
    assert wire.error_body(info.value)["error"]["param"] == param


def test_previous_response_id_error_says_we_are_stateless() -> None:
    with pytest.raises(InvalidRequest, match="whole conversation"):
        parse({"input": "x", "previous_response_id": "resp_1"})


@pytest.mark.parametrize("raw", [{}, {"input": 3}, {"input": [{"role": "robot", "content": "x"}]}])
def test_malformed_body_is_a_400(raw: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        wire.parse_body(raw)


# ---------------------------------------------------------------- responses


def test_rendered_response_validates_as_the_sdk_type() -> None:
    req = parse({"input": USER, "tools": TOOLS, "tool_choice": "required", "temperature": 0.3})
    resp = Response.model_validate(wire.render_completion(completion(req), req))
    assert (resp.id, resp.status, resp.object) == ("resp_abc123", "completed", "response")
    assert [o.type for o in resp.output] == ["reasoning", "message", "function_call",
                                             "function_call"]
    reasoning, message, call1, call2 = resp.output
    assert reasoning.content and reasoning.content[0].text == REPLY.reasoning  # type: ignore[union-attr]
    assert message.content[0].text == REPLY.content  # type: ignore[union-attr]
    assert (call1.call_id, call1.name, call1.arguments) == ("call_1", "get_weather",  # type: ignore[union-attr]
                                                            '{"city": "Paris"}')
    assert call2.call_id == "call_2"  # type: ignore[union-attr]
    assert len({o.id for o in resp.output}) == 4  # type: ignore[union-attr]
    assert resp.usage is not None and (resp.usage.input_tokens, resp.usage.output_tokens,
                                       resp.usage.total_tokens) == (42, 11, 53)
    assert resp.tool_choice == "required" and [t.name for t in resp.tools] == [  # type: ignore[union-attr]
        "get_weather", "get_time"]
    assert resp.temperature == 0.3
    assert resp.interaction_id == "int-0"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("finish", "status", "reason"), [
    ("stop", "completed", None), ("tool_calls", "completed", None),
    ("length", "incomplete", "max_output_tokens"), ("abort", "incomplete", None)])
def test_finish_reasons_map_to_status(finish: str, status: str, reason: str | None) -> None:
    req = parse({"input": "x"})
    resp = Response.model_validate(wire.render_completion(
        completion(req, ParsedReply(content="partial"), finish)))
    assert resp.status == status
    assert (resp.incomplete_details.reason if resp.incomplete_details else None) == reason
    assert resp.output[0].status == ("completed" if status == "completed" else "incomplete")  # type: ignore[union-attr]


def test_sdk_client_reads_a_non_streamed_response() -> None:
    resp = client_for(fake_gateway([])).responses.create(model="m", input="hi", tools=TOOLS)  # type: ignore[arg-type]
    assert resp.output_text == REPLY.content
    assert [o.type for o in resp.output][-1] == "function_call"


# ---------------------------------------------------------------- streaming


def test_stream_events_validate_and_are_numbered_in_order() -> None:
    req = parse({"input": USER, "tools": TOOLS, "stream": True})
    evs = events(stream_frames(req))
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    kinds = [e.type for e in evs]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    for k in ("response.reasoning_text.delta", "response.output_text.done",
              "response.content_part.done", "response.function_call_arguments.done"):
        assert k in kinds
    deltas = [e.delta for e in evs if e.type == "response.function_call_arguments.delta"]
    assert deltas == ['{"city": ', '"Paris"}', '{"tz": "Europe/Paris"}']


def test_accumulated_stream_equals_the_non_streamed_response() -> None:
    req = parse({"input": USER, "tools": TOOLS, "stream": True})
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events(stream_frames(req)):
        state.handle_event(e)
    final = state._completed_response
    assert final is not None
    plain = Response.model_validate(wire.render_completion(completion(req), req))
    assert [json.loads(o.model_dump_json(exclude={"content": {0: {"parsed"}}},
                                         exclude_none=True)) for o in final.output] \
        == [json.loads(o.model_dump_json(exclude_none=True)) for o in plain.output]
    assert final.usage == plain.usage and final.status == plain.status


def test_sdk_stream_helper_reads_our_stream() -> None:
    client = client_for(fake_gateway([]))
    with client.responses.stream(model="m", input="hi", tools=TOOLS) as stream:  # type: ignore[arg-type]
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == REPLY.content == final.output_text
    assert [o.arguments for o in final.output if o.type == "function_call"] == [
        c.arguments for c in REPLY.tool_calls]


def test_cut_reply_streams_response_incomplete_with_the_reason() -> None:
    req = parse({"input": "x", "stream": True})
    evs = events(stream_frames(req, [ContentDelta("half")], finish="length"))
    last = evs[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    done = [e for e in evs if e.type == "response.output_item.done"]
    assert done[0].item.status == "incomplete"


def test_content_after_a_tool_call_opens_a_new_message_item() -> None:
    req = parse({"input": "x", "stream": True})
    script = [ContentDelta("a"), ToolCallDelta(0, "{}", id="c", name="f"), ContentDelta("b")]
    evs = events(stream_frames(req, script))
    added = [e.item.type for e in evs if e.type == "response.output_item.added"]
    assert added == ["message", "function_call", "message"]


def test_arguments_for_a_closed_call_are_refused() -> None:
    req = parse({"input": "x", "stream": True})
    enc = wire.StreamEncoder.for_request(req, "r", 1)
    enc.delta(0, ToolCallDelta(0, "{}", id="c", name="f"))
    enc.delta(0, ContentDelta("text"))
    with pytest.raises(ValueError, match="closed"):
        enc.delta(0, ToolCallDelta(0, "more"))


def test_error_event_parses_as_the_sdk_error_event() -> None:
    req = parse({"input": "x", "stream": True})
    enc = wire.StreamEncoder.for_request(req, "r", 1)
    enc.start()
    (ev,) = events(enc.error(EngineError("engine down")))
    assert ev.type == "error" and ev.message == "engine down" and ev.sequence_number == 2


def test_encoder_refuses_more_than_one_choice() -> None:
    with pytest.raises(ValueError):
        wire.StreamEncoder("r", "m", 1, n=2)


def test_stream_ended_without_finish_closes_its_item_as_incomplete() -> None:
    req = parse({"input": "x", "stream": True})
    enc = wire.StreamEncoder.for_request(req, "r", 1)
    frames = [*enc.start(), *enc.delta(0, ContentDelta("par")), *enc.end(3, 1)]
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events(frames):
        state.handle_event(e)
    last = events(frames)[-1]
    assert last.type == "response.incomplete"
    assert [o.status for o in last.response.output] == ["incomplete"]
    assert last.response.output[0].content[0].text == "par"
