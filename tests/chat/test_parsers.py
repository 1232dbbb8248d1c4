"""Reply parsing: reasoning, tagged and bare tool calls, malformed input, and streaming = whole."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayrl.chat.conversation import (
    ContentDelta,
    ParsedReply,
    ReasoningDelta,
    ReplyDelta,
    ToolCallDelta,
)
from relayrl.chat.parsers import (
    StreamingReplyParser,
    parse_reply,
    prompt_opens_reasoning,
    reply_starts_in_reasoning,
)

WEATHER_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
SEARCH_CALL = '{"name": "search", "arguments": {"q": "a \\"quoted\\" }{ brace"}}'


def calls_of(reply: ParsedReply) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


def test_a_plain_reply_is_all_content() -> None:
    reply = parse_reply("  Hello there!\n")
    assert reply == ParsedReply(content="Hello there!", reasoning=None, tool_calls=())


def test_tagged_calls_with_text_around_them_are_split_out() -> None:
    reply = parse_reply(f"Let me check.\n<tool_call>\n{WEATHER_CALL}\n</tool_call>\n"
                        f"<tool_call>{SEARCH_CALL}</tool_call>\nDone.")
    assert reply.content == "Let me check.\n\n\nDone."
    assert calls_of(reply) == [("get_weather", {"city": "Paris", "days": 2}),
                               ("search", {"q": 'a "quoted" }{ brace'})]
    ids = [c.id for c in reply.tool_calls]
    assert all(i.startswith("call_") and len(i) > 10 for i in ids) and len(set(ids)) == 2


def test_arguments_are_reserialized_as_compact_json_in_their_order() -> None:
    reply = parse_reply('<tool_call>{"name": "f", "arguments": {"b": 1,  "a": [1, 2], "u": "é"}}</tool_call>')
    assert reply.tool_calls[0].arguments == '{"b":1,"a":[1,2],"u":"é"}'
    as_text = parse_reply('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert as_text.tool_calls[0].arguments == '{"x":1}'
    no_args = parse_reply('<tool_call>{"name": "now"}</tool_call>')
    assert no_args.tool_calls[0].arguments == "{}"


@pytest.mark.parametrize("text", [
    "<tool_call>\n" + WEATHER_CALL,  # unclosed
    '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # invalid JSON
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
    "</tool_call> stray closing tag",
])
def test_malformed_calls_stay_as_text_verbatim(text: str) -> None:
    reply = parse_reply(text)
    assert reply.tool_calls == ()
    assert reply.content == text.strip()


def test_a_malformed_call_does_not_hide_a_good_one_after_it() -> None:
    reply = parse_reply(f"<tool_call>{{oops}}</tool_call> then <tool_call>{WEATHER_CALL}</tool_call>")
    assert reply.content == "<tool_call>{oops}</tool_call> then"
    assert [n for n, _ in calls_of(reply)] == ["get_weather"]


@pytest.mark.parametrize("text", [
    WEATHER_CALL,
    f"\n  {WEATHER_CALL}\n",
    f"{WEATHER_CALL}\n{SEARCH_CALL}",
    f"```json\n{WEATHER_CALL}\n```",
    f"```\n{WEATHER_CALL}\n\n{SEARCH_CALL}\n```\n",
    '{"name": "f", "arguments": "{\\"a\\": 1}"}',
])
def test_bare_json_calls_are_calls_when_nothing_else_is_there(text: str) -> None:
    reply = parse_reply(text)
    assert reply.content == ""
    assert len(reply.tool_calls) == text.count('"name"')


@pytest.mark.parametrize("text", [
    f"Here is the call: {WEATHER_CALL}",
    f"{WEATHER_CALL} and that is it",
    '{"name": "f"}',  # no arguments: a bare object must have them
    '{"name": "f", "arguments": {}, }',  # invalid JSON
    '{"result": 42}',
    f"```python\n{WEATHER_CALL}\n```",
    f"```json\n{WEATHER_CALL}\n",  # unclosed fence
    f"```json\n{WEATHER_CALL}\n``` trailing",
    f"[{WEATHER_CALL}]",
])
def test_json_that_is_not_only_calls_stays_text(text: str) -> None:
    reply = parse_reply(text)
    assert reply.tool_calls == ()
    assert reply.content == text.strip()


def test_think_block_is_reasoning() -> None:
    reply = parse_reply("<think>\nFirst, add.\n</think>\n\nThe answer is 4.")
    assert reply.reasoning == "First, add."
    assert reply.content == "The answer is 4."


def test_a_reply_that_starts_inside_reasoning_has_only_the_closing_tag() -> None:
    text = "The user wants weather.\n</think>\n\n" + f"<tool_call>{WEATHER_CALL}</tool_call>"
    assert reply_starts_in_reasoning(text)
    reply = parse_reply(text)
    assert reply.reasoning == "The user wants weather."
    assert reply.content == ""
    assert [n for n, _ in calls_of(reply)] == ["get_weather"]
    assert parse_reply(text, starts_in_reasoning=False).reasoning is None
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_reasoning_then_bare_json_call() -> None:
    reply = parse_reply(f"<think>need weather</think>\n{WEATHER_CALL}")
    assert reply.reasoning == "need weather"
    assert reply.content == ""
    assert [n for n, _ in calls_of(reply)] == ["get_weather"]


def test_an_unclosed_think_makes_the_rest_reasoning() -> None:
    reply = parse_reply("Sure. <think>still thinking when the length ran out")
    assert reply.content == "Sure."
    assert reply.reasoning == "still thinking when the length ran out"


# ---------------------------------------------------------------------------------------------
# Streaming.


def stream(text: str, cuts: list[int], starts_in_reasoning: bool = False
           ) -> tuple[list[ReplyDelta], ParsedReply]:
    parser = StreamingReplyParser(starts_in_reasoning=starts_in_reasoning)
    bounds = [0, *sorted(set(cuts)), len(text)]
    deltas: list[ReplyDelta] = []
    for a, b in itertools.pairwise(bounds):
        deltas += parser.feed(text[a:b])
    deltas += parser.finish()
    return deltas, parser.result()


def joined(deltas: list[ReplyDelta]) -> tuple[str, str, list[tuple[str, object]]]:
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert [d.index for d in calls] == list(range(len(calls)))
    return content, reasoning, [(d.name, json.loads(d.arguments)) for d in calls]


def assert_stream_equals_whole(text: str, cuts: list[int], starts_in_reasoning: bool) -> None:
    deltas, result = stream(text, cuts, starts_in_reasoning)
    whole = parse_reply(text, starts_in_reasoning=starts_in_reasoning)
    content, reasoning, calls = joined(deltas)
    assert (content, reasoning, calls) == (whole.content, whole.reasoning or "", calls_of(whole))
    assert (result.content, result.reasoning, calls_of(result)) == (
        whole.content, whole.reasoning, calls_of(whole))
    assert [c.id for c in result.tool_calls] == [d.id for d in deltas if isinstance(d, ToolCallDelta)]


FRAGMENTS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_", "</thi", "<", ">", "`", "```",
    "```json", "\n", " ", "{", "}", '"', "json", WEATHER_CALL, SEARCH_CALL, '{"name": "f"}',
    '{"name": "g", "arguments": "{\\"k\\": [1]}"}', '{"oops": ', "Hello", "wörld 🌍", "\\",
    '{"name": "x", "arguments": {"s": "</tool_call> inside"}}', f"```json\n{WEATHER_CALL}\n```",
]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(alphabet="ab <>{}\"`\n", max_size=6)),
                 max_size=14).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, data=st.data(), starts_in_reasoning=st.booleans())
def test_streaming_deltas_equal_the_whole_parse_for_any_chunking(
    text: str, data: st.DataObject, starts_in_reasoning: bool,
) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_stream_equals_whole(text, cuts, starts_in_reasoning)


CALL_SEQUENCES = st.lists(st.sampled_from([WEATHER_CALL, SEARCH_CALL]), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(calls=CALL_SEQUENCES, sep=st.sampled_from(["", "\n", " \n "]),
       fence=st.sampled_from([("", ""), ("```json\n", "\n```"), ("```", "```")]),
       think=st.sampled_from(["", "<think>plan</think>\n"]), data=st.data())
def test_bare_call_sequences_stream_as_calls_at_the_end(
    calls: list[str], sep: str, fence: tuple[str, str], think: str, data: st.DataObject,
) -> None:
    text = think + fence[0] + sep.join(calls) + fence[1]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    deltas, result = stream(text, cuts)
    assert len(result.tool_calls) == len(calls) and result.content == ""
    assert_stream_equals_whole(text, cuts, False)
    assert not any(isinstance(d, ContentDelta) for d in deltas)


def test_content_streams_before_the_reply_ends() -> None:
    parser = StreamingReplyParser()
    assert parser.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert parser.feed("ld <tool") == [ContentDelta("ld")]  # " <tool" could still be a tag
    first = parser.feed(f"_call>{WEATHER_CALL}</tool_call>")
    assert len(first) == 1 and isinstance(first[0], ToolCallDelta)
    assert first[0].name == "get_weather" and json.loads(first[0].arguments)["city"] == "Paris"
    # The space held before the call is released with the text after it.
    assert parser.feed(" bye ") == [ContentDelta("  bye")]
    assert parser.finish() == []
    assert parser.result().content == "Hello world  bye"


def test_reasoning_streams_as_reasoning_deltas() -> None:
    parser = StreamingReplyParser(starts_in_reasoning=True)
    assert parser.feed("step one, ") == [ReasoningDelta("step one,")]
    assert parser.feed("step two</th") == [ReasoningDelta(" step two")]
    assert parser.feed("ink>\n\nAnswer") == [ContentDelta("Answer")]
    assert parser.finish() == []
    assert parser.result().reasoning == "step one, step two"


def test_non_json_code_fence_is_released_as_soon_as_it_cannot_be_a_call() -> None:
    parser = StreamingReplyParser()
    assert parser.feed("```") == []
    assert parser.feed("python\nprint(1)") == [ContentDelta("```python\nprint(1)")]
