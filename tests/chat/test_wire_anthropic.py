"""Anthropic Messages wire format, checked against the real `anthropic` SDK.

The SDK talks to our pure converters through an in-memory transport (no server): what it sends is
parsed by `parse_body`/`to_request`; what we render it validates strictly and accumulates with its
own `accumulate_event` (the function behind `MessageStream`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as SdkMessage
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from relayrl.chat import wire_anthropic as wire
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
from relayrl.errors import (
    AuthenticationFailed,
    CapacityExhausted,
    EngineError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    SessionClosed,
)

EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)

TOOLS = [
    {"name": "get_weather", "description": "Weather in a city.",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"name": "get_time", "input_schema": {"type": "object"}},
]
REPLY = ParsedReply(
    content="Let me check both.",
    reasoning="The user wants weather and time.",
    tool_calls=(ToolCall("toolu_1", "get_weather", '{"city": "Paris"}'),
                ToolCall("toolu_2", "get_time", '{"tz": "Europe/Paris"}')),
)
SCRIPT: list[ReplyDelta] = [
    ReasoningDelta("The user wants "), ReasoningDelta("weather and time."),
    ContentDelta("Let me "), ContentDelta("check both."),
    ToolCallDelta(0, '{"city": ', id="toolu_1", name="get_weather"), ToolCallDelta(0, '"Paris"}'),
    ToolCallDelta(1, '{"tz": "Europe/Paris"}', id="toolu_2", name="get_time"),
]
USER = [{"role": "user", "content": "Weather and time in Paris?"}]


def parse(body: dict[str, Any]) -> CompletionRequest:
    return wire.to_request(wire.parse_body({"model": "m", "max_tokens": 100, **body}))


def completion(req: CompletionRequest, reply: ParsedReply = REPLY, finish: str = "tool_calls",
               stop_sequence: str | None = None) -> Completion:
    ch = Choice(index=0, reply=reply, finish_reason=finish,  # type: ignore[arg-type]
                interaction_id="int-0", output_tokens=11, stop_sequence=stop_sequence)
    return Completion(id="abc123", model=req.model, created=1_700_000_000, choices=(ch,),
                      prompt_tokens=42)


def stream_frames(req: CompletionRequest, script: Sequence[ReplyDelta] = SCRIPT,
                  finish: str = "tool_calls", stop_sequence: str | None = None) -> list[str]:
    enc = wire.StreamEncoder.for_request(req, "abc123", 1_700_000_000)
    frames = enc.start(prompt_tokens=42)
    for d in script:
        frames += enc.delta(0, d)
    frames += enc.finish(0, finish, "int-0", stop_sequence)  # type: ignore[arg-type]
    return frames + enc.end(42, 11)


def events(frames: list[str]) -> list[Any]:
    """Parse each frame; the event name must match the data's type; pings are dropped."""
    out = []
    for f in frames:
        head, data = f.removesuffix("\n\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        if payload["type"] != "ping":
            out.append(EVENTS.validate_python(payload))
    return out


def accumulate(frames: list[str]) -> Any:
    snapshot = None
    bufs: dict[int, bytes] = {}
    for e in events(frames):
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def client_for(handler: Callable[[dict[str, Any]], httpx2.Response]) -> anthropic.Anthropic:
    transport = httpx2.MockTransport(lambda r: handler(json.loads(r.content)))
    return anthropic.Anthropic(api_key="k", base_url="http://127.0.0.1", max_retries=0,
                               http_client=httpx2.Client(transport=transport),
                               _strict_response_validation=True)


def fake_gateway(seen: list[CompletionRequest]) -> Callable[[dict[str, Any]], httpx2.Response]:
    def handle(body: dict[str, Any]) -> httpx2.Response:
        try:
            req = wire.to_request(wire.parse_body(body))
        except InvalidRequest as e:
            return httpx2.Response(e.status_code, json=wire.error_body(e))
        seen.append(req)
        if req.stream:
            return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                                   content="".join(stream_frames(req)).encode())
        return httpx2.Response(200, json=wire.render_completion(completion(req), req))
    return handle


# ---------------------------------------------------------------- requests


def test_sdk_request_becomes_conversation() -> None:
    seen: list[CompletionRequest] = []
    client_for(fake_gateway(seen)).messages.create(
        model="policy", max_tokens=256,
        system=[{"type": "text", "text": "Be brief."},
                {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need a tool.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "18C"}, {"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And the time?"}]},
        ],
        tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"},  # type: ignore[arg-type]
        thinking={"type": "enabled", "budget_tokens": 128}, stop_sequences=["###"],
        metadata={"user_id": "u1"},
        extra_body={"temperature": 0.6, "top_p": 0.9, "top_k": 40},
    )
    req = seen[0]
    assert req.conversation.messages == (
        Message(role="system", content="Be brief.\nUse tools."),
        Message(role="user", content="Weather?"),
        Message(role="assistant", content="Checking.", reasoning="Need a tool.",
                tool_calls=(ToolCall("t1", "get_weather", '{"city": "Paris"}'),)),
        Message(role="tool", content="18C\nsunny", tool_call_id="t1", name="get_weather"),
        Message(role="user", content="And the time?"),
    )
    assert req.conversation.tools[0] == Tool("get_weather", "Weather in a city.",
                                             TOOLS[0]["input_schema"])
    assert req.conversation.tool_choice == "get_time"
    assert req.conversation.template_kwargs == {"enable_thinking": True}
    p = req.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.stop) == (256, 0.6, 0.9, 40,
                                                                           ("###",))
    assert req.metadata["thinking"] == {"type": "enabled", "budget_tokens": 128}
    assert req.metadata["metadata"] == {"user_id": "u1"}


@pytest.mark.parametrize(("choice", "ours"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, "get_weather")])
def test_tool_choice_maps_to_ours(choice: dict[str, Any], ours: str) -> None:
    assert parse({"messages": USER, "tools": TOOLS,
                  "tool_choice": choice}).conversation.tool_choice == ours


def test_tool_results_come_before_the_text_of_the_same_turn() -> None:
    req = parse({"messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "also this"},
            {"type": "tool_result", "tool_use_id": "a", "content": "noon", "is_error": True}]}]})
    assert [(m.role, m.content) for m in req.conversation.messages[2:]] == [
        ("tool", "noon"), ("user", "also this")]


def test_the_system_prompt_and_redacted_thinking() -> None:
    req = parse({"system": "sys", "messages": [
        *USER,
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xx"},
                                          {"type": "text", "text": "hi"}]},
        {"role": "user", "content": "ok"}]})
    assert [(m.role, m.content, m.reasoning) for m in req.conversation.messages] == [
        ("system", "sys", None), ("user", USER[0]["content"], None), ("assistant", "hi", None),
        ("user", "ok", None)]


def test_a_system_turn_inside_messages_is_kept_in_place() -> None:
    # Anthropic documents no system role in messages, but the Claude Code CLI sends one
    req = parse({"messages": [{"role": "system", "content": "sys"}, *USER]})
    assert [m.role for m in req.conversation.messages] == ["system", "user"]
    assert req.conversation.messages[0].content == "sys"


def test_thinking_disabled_turns_template_thinking_off() -> None:
    req = parse({"messages": USER, "thinking": {"type": "disabled"}})
    assert req.conversation.template_kwargs == {"enable_thinking": False}
    assert parse({"messages": USER}).conversation.template_kwargs == {}


@pytest.mark.parametrize("dump", [
    lambda b: b.model_dump(), lambda b: b.model_dump(exclude_none=True), lambda b: b.to_dict()])
def test_echoed_content_blocks_parse_back_to_the_reply(dump: Callable[[Any], Any]) -> None:
    req = parse({"messages": USER, "tools": TOOLS})
    msg = SdkMessage.model_validate(wire.render_completion(completion(req)))
    results = [{"type": "tool_result", "tool_use_id": c.id, "content": "ok"}
               for c in REPLY.tool_calls]
    again = parse({"messages": [*USER, {"role": "assistant",
                                         "content": [dump(b) for b in msg.content]},
                                {"role": "user", "content": results}], "tools": TOOLS})
    msgs = again.conversation.messages
    assert msgs[1] == REPLY.to_message()
    assert [(m.tool_call_id, m.name) for m in msgs[2:]] == [("toolu_1", "get_weather"),
                                                           ("toolu_2", "get_time")]


def test_harmless_fields_are_accepted_and_unknown_ones_listed() -> None:
    body = wire.parse_body({"model": "m", "max_tokens": 5, "messages": USER,
                            "service_tier": "auto", "container": None, "mystery": 1,
                            "thinking": {"type": "adaptive"}})
    wire.to_request(body)
    assert body.extra_fields() == ("mystery",)


ASSISTANT = {"role": "assistant", "content": "hi"}
BAD_REQUESTS = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"repetition_penalty": 1.5}, "repetition_penalty"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1]"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
     "tool_choice.disable_parallel_tool_use"),
    ({"messages": []}, "messages"),
    ({"messages": [*USER, ASSISTANT]}, "messages"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "x"}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "messages.0.content.0"),
    ({"messages": [*USER, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": "x"}]}, *USER]},
     "messages.1.content.0"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}]}]},
     "messages.0.content.0.content.0"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}, *USER]},
     "messages.0.0"),  # a system turn holds text only
]


@pytest.mark.parametrize(("patch", "param"), BAD_REQUESTS)
def test_unservable_request_is_a_400_naming_the_field(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse({"messages": USER, **patch})
    assert info.value.param == param  # type: ignore[attr-defined]
    assert wire.error_body(info.value)["error"]["type"] == "invalid_request_error"


def test_sdk_raises_bad_request_with_our_error_body() -> None:
    client = client_for(fake_gateway([]))
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="m", max_tokens=10, messages=USER,  # type: ignore[arg-type]
                               extra_body={"max_tokens": None})


# ---------------------------------------------------------------- responses


def test_rendered_message_validates_as_the_sdk_type() -> None:
    req = parse({"messages": USER, "tools": TOOLS})
    msg = SdkMessage.model_validate(wire.render_completion(completion(req)))
    assert (msg.id, msg.role, msg.stop_reason, msg.stop_sequence) == ("msg_abc123", "assistant",
                                                                      "tool_use", None)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, call1, call2 = msg.content
    assert thinking.thinking == REPLY.reasoning  # type: ignore[union-attr]
    assert text.text == REPLY.content  # type: ignore[union-attr]
    assert (call1.id, call1.name, call1.input) == ("toolu_1", "get_weather", {"city": "Paris"})  # type: ignore[union-attr]
    assert call2.input == {"tz": "Europe/Paris"}  # type: ignore[union-attr]
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (42, 11)
    assert msg.interaction_id == "int-0"  # type: ignore[attr-defined]


@pytest.mark.parametrize(("finish", "stop", "reason"), [
    ("stop", None, "end_turn"), ("stop", "###", "stop_sequence"), ("length", None, "max_tokens"),
    ("tool_calls", None, "tool_use"), ("abort", None, "max_tokens")])
def test_finish_reasons_map_to_stop_reasons(finish: str, stop: str | None, reason: str) -> None:
    req = parse({"messages": USER})
    msg = SdkMessage.model_validate(wire.render_completion(completion(req, finish=finish,
                                                                      stop_sequence=stop)))
    assert (msg.stop_reason, msg.stop_sequence) == (reason, stop)


@pytest.mark.parametrize("args", ['{"city": "Par', "[1, 2]", '"text"'])
def test_call_without_an_object_input_is_kept_as_text(args: str) -> None:
    req = parse({"messages": USER})
    reply = ParsedReply(content="", tool_calls=(ToolCall("t", "get_weather", args),))
    msg = SdkMessage.model_validate(wire.render_completion(completion(req, reply)))
    (block,) = msg.content
    assert block.type == "text" and json.loads(block.text) == {"name": "get_weather",
                                                               "arguments": args}
    assert msg.stop_reason == "end_turn"  # no tool_use block: nothing for the client to run


def test_empty_arguments_are_an_empty_input() -> None:
    req = parse({"messages": USER})
    reply = ParsedReply(content="", tool_calls=(ToolCall("t", "get_time", ""),))
    msg = SdkMessage.model_validate(wire.render_completion(completion(req, reply)))
    assert msg.content[0].type == "tool_use" and msg.content[0].input == {}  # type: ignore[union-attr]


# ---------------------------------------------------------------- streaming


def test_stream_events_validate_in_the_documented_order() -> None:
    req = parse({"messages": USER, "tools": TOOLS, "stream": True})
    frames = stream_frames(req)
    assert frames[1] == 'event: ping\ndata: {"type":"ping"}\n\n'
    kinds = [e.type for e in events(frames)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4
    evs = events(frames)
    starts = [e for e in evs if e.type == "content_block_start"]
    assert [e.index for e in starts] == [0, 1, 2, 3]
    assert [e.content_block.type for e in starts] == ["thinking", "text", "tool_use", "tool_use"]
    deltas = {e.delta.type for e in evs if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta", "input_json_delta"}
    assert evs[-2].interaction_id == "int-0"


def test_accumulated_stream_equals_the_non_streamed_message() -> None:
    req = parse({"messages": USER, "tools": TOOLS, "stream": True})
    streamed = accumulate(stream_frames(req))
    plain = SdkMessage.model_validate(wire.render_completion(completion(req)))
    assert [b.model_dump(exclude_none=True) for b in streamed.content] \
        == [b.model_dump(exclude_none=True) for b in plain.content]
    assert (streamed.stop_reason, streamed.stop_sequence) == (plain.stop_reason,
                                                              plain.stop_sequence)
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (42, 11)


def test_streamed_stop_sequence_is_reported() -> None:
    req = parse({"messages": USER, "stream": True})
    streamed = accumulate(stream_frames(req, [ContentDelta("done")], "stop", "###"))
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "###")


def test_streamed_call_with_broken_json_becomes_the_same_text_block() -> None:
    req = parse({"messages": USER, "stream": True})
    bad = ToolCall("t", "get_weather", '{"city": ')
    script = [ContentDelta("ok"), ToolCallDelta(0, bad.arguments, id=bad.id, name=bad.name)]
    streamed = accumulate(stream_frames(req, script))
    plain = SdkMessage.model_validate(wire.render_completion(
        completion(req, ParsedReply(content="ok", tool_calls=(bad,)))))
    assert [b.model_dump(exclude_none=True) for b in streamed.content] \
        == [b.model_dump(exclude_none=True) for b in plain.content]
    assert streamed.stop_reason == plain.stop_reason == "end_turn"


def test_sdk_stream_helper_reads_our_stream() -> None:
    client = client_for(fake_gateway([]))
    with client.messages.stream(model="m", max_tokens=50, messages=USER, tools=TOOLS) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == REPLY.content
    assert [b.input for b in final.content if b.type == "tool_use"] == [  # type: ignore[union-attr]
        json.loads(c.arguments) for c in REPLY.tool_calls]


def test_mid_stream_error_event_raises_in_the_sdk() -> None:
    req = parse({"messages": USER, "stream": True})
    enc = wire.StreamEncoder.for_request(req, "x", 1)
    frames = [*enc.start(3), *enc.delta(0, ContentDelta("par")), *enc.error(EngineError("down"))]
    client = client_for(lambda body: httpx2.Response(
        200, headers={"content-type": "text/event-stream"}, content="".join(frames).encode()))
    with pytest.raises(anthropic.APIStatusError, match="overloaded_error"):
        list(client.messages.create(model="m", max_tokens=5, messages=USER, stream=True))  # type: ignore[arg-type]


def test_encoder_refuses_more_than_one_choice() -> None:
    with pytest.raises(ValueError):
        wire.StreamEncoder("x", "m", 1, n=2)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(("exc", "kind"), [
    (InvalidRequest("x"), "invalid_request_error"),
    (AuthenticationFailed("x"), "authentication_error"),
    (NotFound("x"), "not_found_error"),
    (SessionClosed("x"), "invalid_request_error"),
    (PayloadTooLarge("x"), "request_too_large"),
    (CapacityExhausted("x"), "rate_limit_error"),
    (EngineError("x"), "overloaded_error"),
    (RuntimeError("x"), "api_error"),
])
def test_error_body_uses_anthropic_type_names(exc: Exception, kind: str) -> None:
    assert wire.error_body(exc) == {"type": "error", "error": {"type": kind, "message": "x"}}


def test_stream_ended_without_finish_closes_its_blocks_as_cut_off() -> None:
    req = parse({"messages": USER, "stream": True})
    enc = wire.StreamEncoder.for_request(req, "x", 1)
    frames = [*enc.start(3), *enc.delta(0, ContentDelta("par")), *enc.end(3, 1)]
    streamed = accumulate(frames)
    assert [e.type for e in events(frames)].count("content_block_stop") == 1
    assert (streamed.content[0].text, streamed.stop_reason) == ("par", "max_tokens")


def test_server_tools_are_left_out_and_client_options_recorded() -> None:
    body = wire.parse_body({
        "model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"},
                  {"name": "Read", "input_schema": {"type": "object"}}],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}})
    req = wire.to_request(body)
    assert [t.name for t in req.conversation.tools] == ["Read"]
    assert req.metadata["server_tools"] == ["web_search_20250305"]
    assert req.metadata["context_management"]["edits"][0]["keep"] == "all"
    assert req.conversation.template_kwargs["reasoning_effort"] == "high"
