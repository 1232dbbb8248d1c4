"""Chat Completions wire format, checked against the real `openai` SDK.

The SDK talks to our pure converters through an in-memory transport (no server): what it sends is
parsed by `parse_body`/`to_request`, and what we render it validates strictly
(`_strict_response_validation`) and accumulates with its own stream state.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import httpx2
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from relayrl.chat import wire_openai_chat as wire
from relayrl.chat.completion import Choice, Completion, CompletionRequest, TokenLogprob
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
from relayrl.chat.schema.openai_chat import ChatCompletionRequest
from relayrl.chat.wire_common import parse_model
from relayrl.errors import ContextLengthExceeded, InvalidRequest, NotFound

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object",
                                           "properties": {"tz": {"type": "string"}}}}},
]

REPLY = ParsedReply(
    content="Let me check both.",
    reasoning="The user wants weather and time.",
    tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
                ToolCall("call_2", "get_time", '{"tz": "Europe/Paris"}')),
)
# The same reply as a parser streams it: reasoning, content, then two calls (the first split).
SCRIPT: list[ReplyDelta] = [
    ReasoningDelta("The user wants "), ReasoningDelta("weather and time."),
    ContentDelta("Let me "), ContentDelta("check both."),
    ToolCallDelta(0, '{"city": ', id="call_1", name="get_weather"), ToolCallDelta(0, '"Paris"}'),
    ToolCallDelta(1, '{"tz": "Europe/Paris"}', id="call_2", name="get_time"),
]
LOGPROBS = tuple(TokenLogprob(token=t, logprob=-0.25 * i, top=((t, -0.25 * i), ("é", -3.5)))
                 for i, t in enumerate(["The", " user", "Let", " me", "{\"", "Paris", "tz"]))


def completion(req: CompletionRequest, reply: ParsedReply = REPLY, finish: str = "tool_calls",
               logprobs: tuple[TokenLogprob, ...] | None = None) -> Completion:
    choices = tuple(Choice(index=i, reply=reply, finish_reason=finish,  # type: ignore[arg-type]
                           interaction_id=f"int-{i}", logprobs=logprobs, output_tokens=11)
                    for i in range(req.n))
    return Completion(id="abc123", model=req.model, created=1_700_000_000, choices=choices,
                      prompt_tokens=42)


def stream_frames(req: CompletionRequest, script: Sequence[ReplyDelta] = SCRIPT,
                  finish: str = "tool_calls") -> list[str]:
    """Drive an encoder as the gateway does; choices interleave delta by delta."""
    enc = wire.StreamEncoder.for_request(req, "abc123", 1_700_000_000)
    frames = enc.start(prompt_tokens=42)
    for k, d in enumerate(script):
        for i in range(req.n):
            lps = LOGPROBS[k:k + 1] if req.logprobs else None
            frames += enc.delta(i, d, lps)
    for i in range(req.n):
        frames += enc.finish(i, finish, f"int-{i}")  # type: ignore[arg-type]
    return frames + enc.end(42, 11 * req.n)


def client_for(handler: Callable[[dict[str, Any]], httpx2.Response]) -> openai.OpenAI:
    """An SDK client whose transport hands the JSON body to `handler`."""
    transport = httpx2.MockTransport(lambda r: handler(json.loads(r.content)))
    return openai.OpenAI(api_key="k", base_url="http://127.0.0.1/v1", max_retries=0,
                         http_client=httpx2.Client(transport=transport),
                         _strict_response_validation=True)


def fake_gateway(seen: list[CompletionRequest], finish: str = "tool_calls",
                 ) -> Callable[[dict[str, Any]], httpx2.Response]:
    def handle(body: dict[str, Any]) -> httpx2.Response:
        req = wire.to_request(wire.parse_body(body))
        seen.append(req)
        if req.stream:
            return httpx2.Response(200, headers={"content-type": "text/event-stream"},
                                   content="".join(stream_frames(req, finish=finish)).encode())
        lps = LOGPROBS if req.logprobs else None
        return httpx2.Response(200, json=wire.render_completion(completion(req, finish=finish,
                                                                           logprobs=lps)))
    return handle


def parse(body: dict[str, Any]) -> CompletionRequest:
    return wire.to_request(wire.parse_body(body))


# ---------------------------------------------------------------- requests


def test_sdk_request_becomes_conversation_with_every_role() -> None:
    seen: list[CompletionRequest] = []
    client = client_for(fake_gateway(seen))
    client.chat.completions.create(
        model="policy",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "Use tools."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather"},
                                         {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "Need a tool.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather",
                                          "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        ],
        tools=TOOLS, tool_choice="auto", temperature=0.7, top_p=0.9, max_completion_tokens=64,
        stop=["###"], seed=3, logprobs=True, top_logprobs=2, n=2, user="u1",
        metadata={"run": "r1"}, extra_body={"top_k": 20, "chat_template_kwargs": {"x": 1}},
    )
    req = seen[0]
    msgs = req.conversation.messages
    assert [m.role for m in msgs] == ["system", "system", "user", "assistant", "tool"]
    assert msgs[2].content == "Weather\nin Paris?"
    assert msgs[3] == Message(role="assistant", content="", reasoning="Need a tool.",
                              tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris"}'),))
    assert msgs[4] == Message(role="tool", content="18C", tool_call_id="c1", name="get_weather")
    assert req.conversation.tools[0] == Tool("get_weather", "Weather in a city.",
                                             TOOLS[0]["function"]["parameters"])
    assert req.conversation.template_kwargs == {"x": 1}
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.stop, p.seed, p.top_logprobs) \
        == (0.7, 0.9, 20, 64, ("###",), 3, 2)
    assert (req.n, req.logprobs, req.stream, req.model) == (2, True, False, "policy")
    assert req.metadata == {"wire": "openai.chat", "metadata": {"run": "r1"}, "user": "u1"}


def test_defaults_when_the_request_names_no_sampling_fields() -> None:
    req = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert req.params.max_new_tokens == wire.DEFAULT_MAX_TOKENS
    assert (req.params.temperature, req.params.top_p, req.params.top_k) == (1.0, 1.0, 0)
    assert req.conversation.tool_choice == "auto"
    assert (req.n, req.logprobs, req.include_usage) == (1, False, False)


@pytest.mark.parametrize("dump", [
    lambda m: m.model_dump(),                   # pydantic dump, nulls and all
    lambda m: m.model_dump(exclude_none=True),
    lambda m: m.to_dict(),
    lambda m: json.loads(m.model_dump_json()),
])
def test_echoed_assistant_message_parses_back_to_the_reply(dump: Callable[[Any], Any]) -> None:
    req = parse({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    sdk = ChatCompletion.model_validate(wire.render_completion(completion(req)))
    echoed = dump(sdk.choices[0].message)
    if "refusal" in echoed:
        assert echoed["refusal"] is None  # the null fields really travel
    again = parse({"messages": [{"role": "user", "content": "hi"}, echoed,
                                {"role": "tool", "tool_call_id": "call_1", "content": "18C"}],
                   "tools": TOOLS})
    assert again.conversation.messages[1] == REPLY.to_message()
    assert again.conversation.messages[2].name == "get_weather"


def test_echo_with_every_null_field_of_the_sdk_message_parses() -> None:
    echoed = {"role": "assistant", "content": None, "refusal": None, "audio": None,
              "function_call": None, "annotations": [], "reasoning": "r",
              "tool_calls": [{"id": "c", "type": "function",
                              "function": {"name": "get_time", "arguments": "{}"}}]}
    req = parse({"messages": [{"role": "user", "content": "x"}, echoed], "tools": TOOLS})
    assert req.conversation.messages[1] == Message(
        role="assistant", content="", reasoning="r", tool_calls=(ToolCall("c", "get_time", "{}"),))


def test_tool_call_arguments_sent_as_an_object_are_serialized() -> None:
    echoed = {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": "é"}}}]}
    req = parse({"messages": [{"role": "user", "content": "x"}, echoed]})
    assert json.loads(req.conversation.messages[1].tool_calls[0].arguments) == {"a": "é"}


def test_named_tool_choice_and_allowed_tools() -> None:
    named = parse({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                   "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named.conversation.tool_choice == "get_time"
    allowed = parse({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                     "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                         "mode": "required",
                         "tools": [{"type": "function", "function": {"name": "get_time"}}]}}})
    assert allowed.conversation.tool_choice == "required"
    assert [t.name for t in allowed.conversation.tools] == ["get_time"]


def test_harmless_fields_are_accepted_and_unknown_ones_listed() -> None:
    body = wire.parse_body({
        "messages": [{"role": "user", "content": "x"}], "store": True, "service_tier": "auto",
        "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low",
        "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
        "response_format": {"type": "text"}, "parallel_tool_calls": False,
        "repetition_penalty": 1.0, "my_field": 1, "another": "x"})
    wire.to_request(body)
    assert body.extra_fields() == ("another", "my_field", "repetition_penalty")


def test_reasoning_effort_reaches_the_template_unless_kwargs_override_it() -> None:
    a = parse({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low"})
    b = parse({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low",
               "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert a.conversation.template_kwargs == {"reasoning_effort": "low"}
    assert b.conversation.template_kwargs == {"reasoning_effort": "high"}


USER = [{"role": "user", "content": "x"}]
BAD_REQUESTS = [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}}},
     "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools[0]"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1]"),
    ({"max_tokens": 10, "max_completion_tokens": 20}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 0}, "n"),
    ({"n": wire.MAX_N + 1}, "n"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"min_p": 0.1}, "min_p"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [*USER, {"role": "tool", "content": "r"}]}, "messages[1].tool_call_id"),
    ({"messages": [*USER, {"role": "function", "name": "f", "content": "r"}]},
     "messages[1].role"),
    ({"messages": [*USER, {"role": "assistant", "function_call": {"name": "f",
                                                                  "arguments": "{}"}}]},
     "messages[1].function_call"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}]}]},
     "messages[1].tool_calls[0]"),
]


@pytest.mark.parametrize(("patch", "param"), BAD_REQUESTS)
def test_unservable_request_is_a_400_naming_the_field(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse({"model": "m", "messages": USER, **patch})
    assert info.value.status_code == 400
    assert info.value.param == param  # type: ignore[attr-defined]
    assert wire.error_body(info.value)["error"]["param"] == param


@pytest.mark.parametrize("raw", [{}, {"messages": "hi"}, {"messages": [{"role": "robot"}]},
                                 {"messages": USER, "n": "many"},
                                 {"messages": [{"role": ["user"], "content": "hi"}]}])
def test_malformed_body_is_a_400_not_a_validation_traceback(raw: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        wire.parse_body(raw)


# ---------------------------------------------------------------- responses


def test_rendered_completion_validates_as_the_sdk_type() -> None:
    req = parse({"messages": USER, "tools": TOOLS, "logprobs": True, "top_logprobs": 2})
    out = ChatCompletion.model_validate(wire.render_completion(completion(req, logprobs=LOGPROBS)))
    assert out.id == "chatcmpl-abc123" and out.object == "chat.completion"
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == REPLY.content
    assert ch.message.reasoning_content == REPLY.reasoning  # type: ignore[attr-defined]
    assert [(t.id, t.function.name, t.function.arguments) for t in ch.message.tool_calls or []] \
        == [(t.id, t.name, t.arguments) for t in REPLY.tool_calls]
    assert ch.interaction_id == "int-0"  # type: ignore[attr-defined]
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens,
                                      out.usage.total_tokens) == (42, 11, 53)
    lp = ch.logprobs.content if ch.logprobs else None
    assert lp is not None and [e.token for e in lp] == [t.token for t in LOGPROBS]
    assert lp[1].logprob == -0.25 and lp[0].bytes == list(b"The")
    assert lp[0].top_logprobs[1].token == "é" and lp[0].top_logprobs[1].bytes == [0xC3, 0xA9]


def test_only_tool_calls_render_null_content_and_empty_reply_renders_empty_string() -> None:
    req = parse({"messages": USER})
    only_calls = ParsedReply(content="", tool_calls=REPLY.tool_calls)
    msg = wire.render_completion(completion(req, only_calls))["choices"][0]["message"]
    assert msg["content"] is None
    empty = wire.render_completion(completion(req, ParsedReply(content=""), "stop"))
    assert empty["choices"][0]["message"]["content"] == ""
    assert "reasoning_content" not in empty["choices"][0]["message"]


@pytest.mark.parametrize(("ours", "theirs"), [("stop", "stop"), ("length", "length"),
                                              ("tool_calls", "tool_calls"), ("abort", "length")])
def test_finish_reasons_map_to_openai_names(ours: str, theirs: str) -> None:
    req = parse({"messages": USER})
    out = ChatCompletion.model_validate(wire.render_completion(completion(req, finish=ours)))
    assert out.choices[0].finish_reason == theirs


def test_sdk_client_reads_a_non_streamed_completion() -> None:
    client = client_for(fake_gateway([]))
    out = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, n=2)  # type: ignore[arg-type]
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[1].message.tool_calls[1].function.name == "get_time"  # type: ignore[index, union-attr]


# ---------------------------------------------------------------- streaming


def data_frames(frames: list[str]) -> list[str]:
    assert all(f.startswith("data: ") and f.endswith("\n\n") for f in frames)
    return [f[len("data: "):-2] for f in frames]


def test_every_stream_frame_is_a_valid_chunk_and_done_comes_last() -> None:
    req = parse({"messages": USER, "tools": TOOLS, "stream": True, "n": 2, "logprobs": True,
                 "stream_options": {"include_usage": True}})
    payloads = data_frames(stream_frames(req))
    assert payloads[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(p) for p in payloads[:-1]]
    assert {c.id for c in chunks} == {"chatcmpl-abc123"}
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 64
    assert all(c.usage is None for c in chunks[:-1])
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [(f.index, f.finish_reason) for f in finals] == [(0, "tool_calls"), (1, "tool_calls")]
    assert [f.interaction_id for f in finals] == ["int-0", "int-1"]  # type: ignore[attr-defined]


def test_accumulated_stream_equals_the_non_streamed_completion() -> None:
    req = parse({"messages": USER, "tools": TOOLS, "stream": True, "n": 2, "logprobs": True,
                 "stream_options": {"include_usage": True}})
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for p in data_frames(stream_frames(req))[:-1]:
        state.handle_chunk(ChatCompletionChunk.model_validate_json(p))
    streamed = state.get_final_completion()
    plain = ChatCompletion.model_validate(wire.render_completion(completion(req,
                                                                            logprobs=LOGPROBS)))
    assert streamed.usage == plain.usage
    for s, p in zip(streamed.choices, plain.choices, strict=True):
        assert (s.index, s.finish_reason) == (p.index, p.finish_reason)
        assert s.message.content == p.message.content
        assert s.message.reasoning_content == p.message.reasoning_content  # type: ignore[attr-defined]
        assert [(t.id, t.type, t.function.name, t.function.arguments)
                for t in s.message.tool_calls or []] \
            == [(t.id, t.type, t.function.name, t.function.arguments)
                for t in p.message.tool_calls or []]
        assert s.logprobs is not None and p.logprobs is not None
        assert s.logprobs.content == p.logprobs.content


def test_sdk_stream_helper_reads_our_stream() -> None:
    client = client_for(fake_gateway([]))
    with client.chat.completions.stream(model="m", messages=USER, tools=TOOLS) as stream:  # type: ignore[arg-type]
        kinds = {e.type for e in stream}
        final = stream.get_final_completion()
    assert {"content.delta", "tool_calls.function.arguments.done"} <= kinds
    msg = final.choices[0].message
    assert msg.content == REPLY.content
    assert [t.function.arguments for t in msg.tool_calls or []] \
        == [t.arguments for t in REPLY.tool_calls]


def test_empty_streamed_reply_ends_with_empty_content_like_the_rendering() -> None:
    req = parse({"messages": USER, "stream": True})
    state: ChatCompletionStreamState[None] = ChatCompletionStreamState()
    for p in data_frames(stream_frames(req, script=[], finish="stop"))[:-1]:
        state.handle_chunk(ChatCompletionChunk.model_validate_json(p))
    assert state.get_final_completion().choices[0].message.content == ""


def test_logprobs_without_text_still_reach_the_client() -> None:
    req = parse({"messages": USER, "stream": True, "logprobs": True})
    enc = wire.StreamEncoder.for_request(req, "x", 1)
    (frame,) = enc.delta(0, None, LOGPROBS[:2])
    chunk = ChatCompletionChunk.model_validate_json(data_frames([frame])[0])
    assert chunk.choices[0].logprobs is not None
    assert [e.token for e in chunk.choices[0].logprobs.content or []] == ["The", " user"]
    assert enc.delta(0, None, None) == []


def test_logprobs_are_left_out_when_not_requested() -> None:
    req = parse({"messages": USER, "stream": True})
    enc = wire.StreamEncoder.for_request(req, "x", 1)
    (frame,) = enc.delta(0, ContentDelta("hi"), LOGPROBS[:1])
    assert json.loads(data_frames([frame])[0])["choices"][0]["logprobs"] is None


def test_mid_stream_error_frame_raises_api_error_in_the_sdk() -> None:
    req = parse({"messages": USER, "stream": True})
    enc = wire.StreamEncoder.for_request(req, "x", 1)
    frames = [*enc.start(), *enc.delta(0, ContentDelta("par")), *enc.error(NotFound("gone"))]
    client = client_for(lambda body: httpx2.Response(
        200, headers={"content-type": "text/event-stream"}, content="".join(frames).encode()))
    with pytest.raises(openai.APIError, match="gone"):
        list(client.chat.completions.create(model="m", messages=USER, stream=True))  # type: ignore[arg-type]


# ---------------------------------------------------------------- errors


def test_error_body_has_openai_shape_and_codes() -> None:
    body = wire.error_body(ContextLengthExceeded("too long"))
    assert body == {"error": {"message": "too long", "type": "invalid_request_error",
                              "param": None, "code": "context_length_exceeded"}}
    assert wire.error_body(NotFound("no session"))["error"]["type"] == "not_found_error"
    assert wire.error_body(RuntimeError("boom"))["error"]["type"] == "api_error"


def test_sdk_raises_bad_request_with_our_error_body() -> None:
    def handle(body: dict[str, Any]) -> httpx2.Response:
        try:
            parse(body)
        except InvalidRequest as e:
            return httpx2.Response(e.status_code, json=wire.error_body(e))
        raise AssertionError("expected a 400")

    client = client_for(handle)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, presence_penalty=1.0)  # type: ignore[arg-type]
    assert info.value.param == "presence_penalty"
    assert info.value.type == "invalid_request_error"


# ---------------------------------------------------------------- plain turns skip pydantic

_TURN = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                           "content": st.text(max_size=12)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=12),
                           "name": st.text(min_size=1, max_size=4)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(),
                           "tool_calls": st.just([{"id": "c1", "type": "function", "function": {
                               "name": "get_weather", "arguments": "{}"}}])}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": st.text(max_size=8),
                           "tool_call_id": st.just("c1")}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.just([
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}])}),
    st.just({"role": "user", "content": "x" * (wire.INTERN_CHARS + 1)}),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_TURN, min_size=1, max_size=8))
def test_plain_turns_convert_as_the_validated_path_does(msgs: list[dict[str, Any]]) -> None:
    raw = {"model": "m", "messages": msgs, "tools": TOOLS}
    fast = wire.to_request(wire.parse_body(raw)).conversation
    slow = wire.to_request(parse_model(ChatCompletionRequest, raw)).conversation
    assert fast == slow


def test_a_bad_message_after_plain_turns_is_named_by_its_place_in_the_request() -> None:
    msgs = [*USER, {"role": "assistant", "content": "ok"}, {"role": "robot", "content": "hi"}]
    with pytest.raises(InvalidRequest) as info:
        wire.parse_body({"model": "m", "messages": msgs})
    assert info.value.param == "messages.2.role"  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequest) as info:
        parse({"model": "m", "messages": [*msgs[:2], {"role": "tool", "content": "3"}]})
    assert info.value.param == "messages[2].tool_call_id"  # type: ignore[attr-defined]


def test_a_request_of_plain_turns_only_still_needs_a_message() -> None:
    with pytest.raises(InvalidRequest, match="must not be empty"):
        parse({"model": "m", "messages": []})


def test_re_sent_tool_calls_and_results_become_the_same_turn_objects() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}

    def body(result: str) -> dict[str, Any]:
        return {"model": "m", "messages": [
            {"role": "user", "content": "1 + 2?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": result}]}

    first = wire.to_request(wire.parse_body(body("3"))).conversation.messages
    again = wire.to_request(wire.parse_body(body("3"))).conversation.messages
    # shared by value: the session's parent lookup and the render cache reuse their work
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert first[2].name == "add" and first[1].tool_calls[0].arguments == '{"a": 1, "b": 2}'
    other = wire.to_request(wire.parse_body(body("4"))).conversation.messages
    assert other[1] is first[1] and other[2] is not first[2] and other[2].content == "4"
    huge = "x" * (wire.INTERN_CHARS + 1)  # a big tool result is not kept
    big1, big2 = (wire.to_request(wire.parse_body(body(huge))).conversation.messages[2]
                  for _ in range(2))
    assert big1 == big2 and big1 is not big2
