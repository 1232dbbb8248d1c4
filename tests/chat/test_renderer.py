"""The Renderer against transformers' apply_chat_template, token for token, and incremental prompts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from relayrl.chat.conversation import Conversation, Message, Tool, ToolCall, canonical_message
from relayrl.chat.parsers import parse_reply
from relayrl.chat.renderer import Renderer, first_divergence, template_message
from relayrl.errors import InvalidRequest

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
"""SmolLM2 with relayrl's tool template; Qwen2.5 with its official template."""
SMOL, QWEN = MODELS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web; returns snippets",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer", "default": 3}},
        "required": ["query"]}}}


def call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# OpenAI-style conversations, given to HF as they are and to our Renderer through `to_conversation`.
CASES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": ([{"role": "user", "content": "What is 2+2?"}], None),
    "with_system": ([{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Hi there"}], None),
    "multi_turn": ([
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green."},
        {"role": "user", "content": "One more, please."},
    ], None),
    "tools_listed": ([{"role": "user", "content": "What's the weather in Oslo?"}], [WEATHER, SEARCH]),
    "tool_call_and_result": ([
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("call_1", "get_weather", {"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
    ], [WEATHER]),
    "parallel_tool_calls": ([
        {"role": "user", "content": "Weather in Paris and Tokyo, and search for umbrellas."},
        {"role": "assistant", "content": "Let me check all three.", "tool_calls": [
            call("call_a", "get_weather", {"city": "Paris"}),
            call("call_b", "get_weather", {"city": "東京"}),
            call("call_c", "search", {"query": "best umbrellas", "limit": 2})]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18°C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "25°C, rain"},
        {"role": "tool", "tool_call_id": "call_c", "content": '["a", "b"]'},
        {"role": "assistant", "content": "Paris 18°C; Tokyo 25°C with rain. Umbrellas: a, b."},
        {"role": "user", "content": "Thanks 🙏"},
    ], [WEATHER, SEARCH]),
    "tool_results_without_tools_listed": ([
        {"role": "user", "content": "Look it up"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("call_9", "search", {"query": "x"})]},
        {"role": "tool", "tool_call_id": "call_9", "content": "nothing found"},
    ], None),
    "invalid_json_arguments_kept_raw": ([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("call_x", "search", '{"query": "unterminated')]},
        {"role": "tool", "tool_call_id": "call_x", "content": "error: bad arguments"},
    ], [SEARCH]),
    "unicode_and_unnormalized_text": ([
        {"role": "user", "content": "Cafe\u0301 ☕️, naïve, 日本語, 👩‍👩‍👧 and a tab\tplus  spaces\n\n\nend"},
    ], None),
    "reasoning_content_on_history": ([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two plus two is four"},
        {"role": "user", "content": "3+3?"},
    ], None),
}


def to_message(d: dict[str, Any]) -> Message:
    calls = tuple(
        ToolCall(id=c["id"], name=c["function"]["name"],
                 arguments=a if isinstance(a := c["function"]["arguments"], str) else json.dumps(a))
        for c in d.get("tool_calls") or ()
    )
    return Message(role=d["role"], content=d.get("content") or "",
                   reasoning=d.get("reasoning_content"), tool_calls=calls,
                   tool_call_id=d.get("tool_call_id"), name=d.get("name"))


def to_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Conversation:
    return Conversation(
        messages=tuple(to_message(m) for m in messages),
        tools=tuple(Tool(name=t["function"]["name"], description=t["function"]["description"],
                         parameters=t["function"]["parameters"]) for t in tools or ()),
    )


def hf_ids(hf: Any, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool) -> list[int]:
    return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  tokenize=True, return_dict=False)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("model", MODELS)
def test_render_matches_transformers_apply_chat_template_token_for_token(
    model: str, case: str, add_generation_prompt: bool,
    renderer_for: Callable[[str], Renderer], hf_tokenizer_for: Callable[[str], Any],
) -> None:
    messages, tools = CASES[case]
    expected = hf_ids(hf_tokenizer_for(model), messages, tools, add_generation_prompt)
    got = renderer_for(model).render(to_conversation(messages, tools), add_generation_prompt)
    assert got == expected


@pytest.mark.parametrize("model", MODELS)
def test_tokenizer_pipeline_is_the_one_transformers_uses(
    model: str, model_path: Callable[[str], str], hf_tokenizer_for: Callable[[str], Any],
) -> None:
    ours = json.loads(Tokenizer.from_file(str(Path(model_path(model)) / "tokenizer.json")).to_str())
    theirs = json.loads(hf_tokenizer_for(model).backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "decoder", "added_tokens", "model"):
        assert ours[part] == theirs[part], part


@pytest.mark.parametrize("model", MODELS)
def test_encode_and_decode_agree_with_transformers(
    model: str, renderer_for: Callable[[str], Renderer], hf_tokenizer_for: Callable[[str], Any],
) -> None:
    r, hf = renderer_for(model), hf_tokenizer_for(model)
    text = "Ünïcödé e\u0301 🤖🧪 <|im_end|> code:\n\tdef f(x):  return x**2  # 二乗\n"
    ids = r.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert r.decode(ids) == hf.decode(ids)
    assert r.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert "".join(r.token_strings(r.encode("plain ascii words"))) == "plain ascii words"
    assert len(r.token_strings(ids)) == len(ids)


@pytest.mark.parametrize("model", MODELS)
def test_stop_tokens_are_the_end_of_turn_and_end_of_text(
    model: str, renderer_for: Callable[[str], Renderer], hf_tokenizer_for: Callable[[str], Any],
) -> None:
    r, hf = renderer_for(model), hf_tokenizer_for(model)
    assert r.eos_token_id == hf.eos_token_id
    assert set(r.token_strings(r.stop_token_ids)) == {"<|im_end|>", "<|endoftext|>"}
    assert r.vocab_size >= len(hf)


def test_the_chat_layer_imports_without_torch_or_transformers() -> None:
    code = ("import sys, relayrl.chat.renderer, relayrl.chat.parsers, relayrl.chat.detokenize; "
            "bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_from_pretrained_is_cached_per_path(
    model_path: Callable[[str], str], renderer_for: Callable[[str], Renderer],
) -> None:
    assert Renderer.from_pretrained(model_path(SMOL)) is renderer_for(SMOL)


# ---------------------------------------------------------------------------------------------
# Incremental prompts.

AGENT_RUN: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        call("call_a", "get_weather", {"city": "Paris"}),
        call("call_b", "get_weather", {"city": "Tokyo"})]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18°C sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "25°C rain"},
    {"role": "assistant", "content": "Paris: 18°C and sunny. Tokyo: 25°C with rain."},
    {"role": "user", "content": "And Rome? 🇮🇹"},
    {"role": "assistant", "content": "Checking Rome.",
     "tool_calls": [call("call_c", "get_weather", {"city": "Rome"})]},
    {"role": "tool", "tool_call_id": "call_c", "content": "22°C"},
    {"role": "assistant", "content": "Rome is 22°C."},
    {"role": "user", "content": "Thanks!"},
]


def template_reply_ids(r: Renderer, before: Conversation, reply: Message, ended_by: str) -> list[int]:
    """What the model samples if it writes exactly the template's rendering of `reply`.

    `ended_by="stop"`: up to and including the end-of-turn token; `"length"`: cut just before it.
    """
    prompt = r.render(before, add_generation_prompt=True)
    whole = r.render(Conversation((*before.messages, reply), before.tools), add_generation_prompt=False)
    assert whole[:len(prompt)] == prompt
    tail = whole[len(prompt):]
    end = max(i for i, t in enumerate(tail) if t in r.stop_token_ids)
    return tail[:end + 1] if ended_by == "stop" else tail[:end]


def run_agent(r: Renderer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              ended_by: str) -> list[tuple[list[int], list[int]]]:
    """Walk an agent run call by call with `extend`; return (extended ids, full render) per call."""
    conv = to_conversation(messages, tools)
    calls = [i for i, m in enumerate(conv.messages) if m.role == "assistant"] + [len(conv.messages)]
    prev_ids: list[int] | None = None
    prev_msgs: tuple[Message, ...] = ()
    pairs = []
    for i in calls:
        now = Conversation(conv.messages[:i], conv.tools)
        full = r.render(now)
        ids = full if prev_ids is None else r.extend(prev_ids, prev_msgs, now)
        assert ids is not None
        pairs.append((ids, full))
        if i < len(conv.messages):
            prev_ids = ids + template_reply_ids(r, now, conv.messages[i], ended_by)
            prev_msgs = conv.messages[:i + 1]
    return pairs


@pytest.mark.parametrize("ended_by", ["stop", "length"])
@pytest.mark.parametrize("with_system", [True, False])
@pytest.mark.parametrize("model", MODELS)
def test_extend_equals_a_full_render_when_the_model_wrote_what_the_template_renders(
    model: str, with_system: bool, ended_by: str, renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(model)
    assert r.extends_prefix
    system = [{"role": "system", "content": "You are a weather agent."}] if with_system else []
    pairs = run_agent(r, system + AGENT_RUN, [WEATHER], ended_by)
    assert len(pairs) == 5
    for ids, full in pairs:
        assert ids == full


@pytest.mark.parametrize("model", MODELS)
def test_boundary_glue_depends_on_how_the_sampled_output_ended(
    model: str, renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(model)
    im_end, endoftext = (r.encode(t)[0] for t in ("<|im_end|>", "<|endoftext|>"))
    text_token = r.encode("done")[-1]
    assert r.boundary_glue([text_token, im_end]) == "\n"
    assert r.boundary_glue([im_end, text_token]) == "<|im_end|>\n"  # cut by length
    assert r.boundary_glue([text_token, endoftext]) == "<|im_end|>\n"  # a stop the template never writes
    # The glue is the template's own text between a reply and the next turn.
    conv = to_conversation(CASES["multi_turn"][0], None)
    assert r.render_text(conv, False).split("Blue.", 1)[1].startswith(r.boundary_glue([text_token]))


@pytest.mark.parametrize("model", MODELS)
def test_extend_after_a_length_cut_closes_the_turn_without_retokenizing_the_output(
    model: str, renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(model)
    first = Conversation((Message("user", "Count to ten"),))
    prompt = r.render(first)
    sampled = r.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 1")  # ended by length mid-number
    reply = Message("assistant", r.decode(sampled))
    second = Conversation((*first.messages, reply, Message("user", "You stopped early.")))
    ids = r.extend(prompt + sampled, (*first.messages, reply), second)
    assert ids is not None
    assert ids[:len(prompt) + len(sampled)] == prompt + sampled
    assert r.decode(ids[len(prompt) + len(sampled):]) == (
        "<|im_end|>\n<|im_start|>user\nYou stopped early.<|im_end|>\n<|im_start|>assistant\n")


def assert_differs_only_inside_the_reply(r: Renderer, prompt: list[int], sampled: list[int],
                                         ids: list[int], full: list[int]) -> None:
    """Same prompt before the reply, same glue + new turns after it; only the reply differs."""
    assert ids != full
    assert ids[:len(prompt)] == full[:len(prompt)] == prompt
    after = ids[len(prompt) + len(sampled):]
    assert full[-len(after):] == after
    assert ids[len(prompt):len(prompt) + len(sampled)] == sampled


def test_extend_keeps_a_bare_json_tool_call_that_the_template_renders_in_tags(
    renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(QWEN)
    first = to_conversation([{"role": "user", "content": "Weather in Paris?"}], [WEATHER])
    prompt = r.render(first)
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    sampled = [*r.encode(text), r.eos_token_id]
    reply = parse_reply(text).to_message()
    assert reply.tool_calls[0].name == "get_weather"
    result = Message("tool", "18°C", tool_call_id=reply.tool_calls[0].id)
    second = Conversation((*first.messages, reply, result), first.tools)
    ids = r.extend(prompt + sampled, (*first.messages, reply), second)
    full = r.render(second)
    assert ids is not None
    assert_differs_only_inside_the_reply(r, prompt, sampled, ids, full)
    assert "<tool_call>" in r.decode(full[len(prompt):])
    assert "<tool_call>" not in r.decode(ids[len(prompt):])


def test_extend_keeps_reasoning_the_template_does_not_render(
    renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(SMOL)
    first = Conversation((Message("user", "2+2?"),))
    prompt = r.render(first)
    text = "<think>two and two</think>4"
    sampled = [*r.encode(text), r.eos_token_id]
    reply = parse_reply(text).to_message()
    assert reply.reasoning == "two and two"
    second = Conversation((*first.messages, reply, Message("user", "Sure?")))
    ids = r.extend(prompt + sampled, (*first.messages, reply), second)
    assert ids is not None
    assert_differs_only_inside_the_reply(r, prompt, sampled, ids, r.render(second))
    # A client that does not send reasoning back continues the same token sequence.
    resent = Conversation((*first.messages, Message("assistant", reply.content), second.messages[-1]))
    assert r.extend(prompt + sampled, (*first.messages, reply), resent) == ids


@pytest.mark.parametrize("model", MODELS)
def test_extend_refuses_an_edited_history_and_says_where(
    model: str, renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(model)
    conv = to_conversation(CASES["multi_turn"][0], None)
    prev = conv.messages[:2]
    prev_ids = r.render(Conversation(prev), add_generation_prompt=False)
    edited = Conversation((Message("user", "Name a color."), *conv.messages[1:]))
    assert r.extend(prev_ids, prev, edited) is None
    assert first_divergence(prev, edited.messages) == 0
    shorter = Conversation(conv.messages[:1])
    assert r.extend(prev_ids, prev, shorter) is None
    assert first_divergence(prev, shorter.messages) == 1
    assert r.extend(prev_ids, prev, conv) is not None


def test_extend_refuses_when_the_tools_change_because_qwen_rewrites_its_system_prompt(
    renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(QWEN)
    messages = to_conversation(CASES["multi_turn"][0], None).messages
    before = Conversation(messages[:2])
    prev_ids = r.render(before, add_generation_prompt=False)
    with_tools = to_conversation(CASES["multi_turn"][0], [WEATHER])
    # With tools, Qwen's (default) system prompt lists them: the old prompt is no longer a prefix.
    assert not r.render_text(with_tools).startswith(r.render_text(before, False))
    assert r.extend(prev_ids, before, with_tools) is None
    assert r.extend(prev_ids, before, Conversation(messages)) is not None


def test_extend_accepts_tool_call_json_with_other_key_order_and_spacing(
    renderer_for: Callable[[str], Renderer],
) -> None:
    r = renderer_for(QWEN)
    messages, tools = CASES["parallel_tool_calls"]
    conv = to_conversation(messages, tools)
    prev = conv.messages[:2]
    prev_ids = r.render(Conversation(prev, conv.tools), add_generation_prompt=False)
    resent = list(conv.messages)
    resent[1] = Message("assistant", prev[1].content, tool_calls=tuple(
        ToolCall(c.id, c.name, json.dumps(dict(reversed(json.loads(c.arguments).items())), indent=2))
        for c in prev[1].tool_calls))
    assert canonical_message(resent[1]) == canonical_message(prev[1])
    assert r.extend(prev_ids, prev, Conversation(tuple(resent), conv.tools)) is not None


def test_canonical_message_forgives_only_what_clients_change() -> None:
    base = Message("assistant", "hi", tool_calls=(ToolCall("c1", "f", '{"a": 1, "b": [1, 2]}'),))
    same = Message("assistant", "hi", tool_calls=(ToolCall("c1", "f", '{"b":[1,2],"a":1}'),))
    assert canonical_message(base) == canonical_message(same)
    # Clients rarely send reasoning back; the stored tokens keep it, so it does not break a segment.
    with_reasoning = Message("assistant", "hi", reasoning="r", tool_calls=base.tool_calls)
    assert canonical_message(with_reasoning) == canonical_message(base)
    assert canonical_message(Message("tool", "x", tool_call_id=None)) == canonical_message(
        Message("tool", " x\n", name=""))
    assert canonical_message(Message("assistant", tool_calls=(ToolCall("c", "f", ""),))) == \
        canonical_message(Message("assistant", tool_calls=(ToolCall("c", "f", "{ }"),)))
    for changed in (Message("assistant", "hi!", tool_calls=base.tool_calls),
                    Message("assistant", "hi", tool_calls=(ToolCall("c1", "f", '{"a": 1, "b": [2, 1]}'),)),
                    Message("assistant", "hi", tool_calls=(ToolCall("c1", "f", '{"a": 2, "b": [1, 2]}'),)),
                    Message("assistant", "hi", tool_calls=(ToolCall("c2", "f", '{"a": 1, "b": [1, 2]}'),)),
                    Message("user", "hi", tool_calls=base.tool_calls)):
        assert canonical_message(changed) != canonical_message(base)


def test_template_message_is_the_openai_shape_with_parsed_arguments() -> None:
    m = Message("assistant", "", reasoning="why", tool_calls=(ToolCall("c1", "f", '{"x": [1]}'),
                                                              ToolCall("c2", "g", "not json")))
    d = template_message(m)
    assert "content" not in d
    assert d["reasoning_content"] == d["thinking"] == "why"
    assert d["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": [1]}}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]
    assert template_message(Message("tool", "r", tool_call_id="c1", name="f")) == {
        "role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"}


# ---------------------------------------------------------------------------------------------
# Templates other than the packaged ones.

CHATML_LOOP = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content and loop.last %}"
    "<think>{{ m.reasoning_content }}</think>\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DROPS_OLD_REASONING = CHATML_LOOP
"""Renders reasoning only on the last message, as Qwen3's template drops earlier reasoning."""
COUNTS_MESSAGES = "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n" + CHATML_LOOP
"""Rewrites its first line on every turn: never append-only."""
NUMBERS_TURNS = (
    "{% for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {{ messages | length + 1 }}\n"
    "{% endif %}"
)
"""Append-only, but a turn's text depends on how many came before: not local."""
WANTS_USER_AFTER_SYSTEM = (
    "{% for m in messages %}"
    "{% if loop.index0 == 1 and messages[0].role == 'system' and m.role != 'user' %}"
    "{{ raise_exception('the first turn after the system prompt must be the user') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Local, but refuses a window that drops the first user turn (as role-order checks do)."""


@pytest.fixture(scope="module")
def smol_tokenizer(model_path: Callable[[str], str]) -> Tokenizer:
    return Tokenizer.from_file(str(Path(model_path(SMOL)) / "tokenizer.json"))


def custom(tokenizer: Tokenizer, template: str) -> Renderer:
    return Renderer(tokenizer, {"default": template}, {"eos_token": "<|im_end|>"})


def one_step(r: Renderer, reply: Message) -> tuple[list[int], Sequence[Message], Conversation]:
    first = Conversation((Message("user", "q1"),))
    prev_ids = r.render(Conversation((*first.messages, reply)), add_generation_prompt=False)[:-1]
    return prev_ids, (*first.messages, reply), Conversation((*first.messages, reply, Message("user", "q2")))


def test_a_template_that_rewrites_history_is_not_append_only_and_extend_refuses(
    smol_tokenizer: Tokenizer,
) -> None:
    r = custom(smol_tokenizer, COUNTS_MESSAGES)
    assert not r.extends_prefix
    assert r.extend(*one_step(r, Message("assistant", "a1"))) is None


def test_a_template_that_drops_old_reasoning_still_extends_after_the_reply(
    smol_tokenizer: Tokenizer,
) -> None:
    r = custom(smol_tokenizer, DROPS_OLD_REASONING)
    assert not r.extends_prefix  # because of the reasoning probe
    prev_ids, prev, conv = one_step(r, Message("assistant", "a1", reasoning="because"))
    ids = r.extend(prev_ids, prev, conv)
    assert ids is not None and ids[:len(prev_ids)] == prev_ids
    assert "because" in r.decode(ids) and "because" not in r.render_text(conv)
    assert r.decode(ids).endswith("a1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n")


def test_hf_template_helpers_render_like_transformers(
    smol_tokenizer: Tokenizer, hf_tokenizer_for: Callable[[str], Any],
) -> None:
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}"
        "{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}[{{ m.role }}|{{ m.content }}]"
        "{% endgeneration %}{% if ns.n > 5 %}{% break %}{% endif %}{% endfor %}"
        "{{ tools | tojson(indent=2) }}{{ dict(a='ü') | tojson }}{{ bos_token }}{{ eos_token }}"
        "{{ strftime_now('%Y') | length }}{{ flag }}"
    )
    messages, tools = CASES["parallel_tool_calls"]
    conv = to_conversation(messages, tools)
    conv = Conversation(conv.messages, conv.tools, template_kwargs={"flag": "on"})
    hf = hf_tokenizer_for(SMOL)
    expected = hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                      add_generation_prompt=True, flag="on")
    r = Renderer(smol_tokenizer, {"default": template},
                 {"bos_token": hf.bos_token, "eos_token": hf.eos_token})
    assert r.render_text(conv) == expected


def test_a_template_that_rejects_the_conversation_raises_invalid_request(
    smol_tokenizer: Tokenizer,
) -> None:
    r = custom(smol_tokenizer, "{% if messages[0].role == 'tool' %}{{ raise_exception('no tool first') }}"
                               "{% endif %}" + CHATML_LOOP)
    with pytest.raises(InvalidRequest, match="no tool first"):
        r.render(Conversation((Message("tool", "x"),)))
    with pytest.raises(InvalidRequest):
        r.render(Conversation(()))


def test_templates_named_in_tokenizer_config_are_picked_like_transformers_picks_them(
    tmp_path: Path, model_path: Callable[[str], str],
) -> None:
    from transformers import AutoTokenizer

    source = Path(model_path(SMOL))
    (tmp_path / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain:" + CHATML_LOOP},
        {"name": "tool_use", "template": "tools:{{ tools | length }}:" + CHATML_LOOP},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    r = Renderer.from_pretrained(str(tmp_path))
    for case in ("multi_turn", "tool_call_and_result"):
        messages, tools = CASES[case]
        assert r.render(to_conversation(messages, tools)) == hf_ids(hf, messages, tools, True)
    assert r.render_text(to_conversation(*CASES["tools_listed"])).startswith("tools:2:")


def test_the_sandbox_fast_path_resolves_dict_attributes_as_jinjas_sandbox_does() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from relayrl.chat.renderer import compile_template

    source = ("{{ m.role }}|{{ m.missing is defined }}|{{ m.items is defined }}|"
              "{{ m.get('role') }}|{{ m.__class__ is defined }}|{{ m.keys | string }}|"
              "{{ m.update is defined }}|{{ m.content or 'none' }}")
    # `keys`, `items`, `update` are dict's own names: the attribute wins over the key, and the
    # immutable sandbox hides mutators; `__class__` stays unsafe.
    for m in ({"role": "user", "content": "hi"},
              {"role": "tool", "items": "shadowed", "keys": 3, "update": 1, "content": None}):
        ours = compile_template(source).render(m=m)
        theirs = ImmutableSandboxedEnvironment().from_string(source).render(m=m)
        assert ours == theirs
    assert compile_template(source).render(m={"role": "user"}).startswith("user|False|True|user|")


def long_run(turns: int) -> list[Message]:
    """A system prompt, a question, then `turns` assistant/user exchanges."""
    msgs = [Message("system", "be brief"), Message("user", "q0")]
    for i in range(turns):
        msgs += [Message("assistant", f"a{i}"), Message("user", f"q{i + 1}")]
    return msgs


def walk_extend(r: Renderer, msgs: list[Message]) -> list[tuple[list[int], list[int]]]:
    """Every call of `msgs` built with `extend` from the previous one, beside its full render."""
    pairs = []
    prev_ids: list[int] | None = None
    for i in range(2, len(msgs) + 1, 2):
        conv = Conversation(tuple(msgs[:i]))
        full = r.render(conv)
        ids = full if prev_ids is None else r.extend(prev_ids, msgs[:i - 1], conv)
        assert ids is not None
        pairs.append((ids, full))
        if i < len(msgs):
            reply = r.encode(msgs[i].content + "<|im_end|>")
            prev_ids = ids + reply
    return pairs


@pytest.mark.parametrize("model", MODELS)
def test_extend_renders_a_window_not_the_whole_history_and_still_equals_a_full_render(
    model: str, renderer_for: Callable[[str], Renderer], monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = renderer_for(model)
    assert r.renders_locally
    msgs = long_run(30)
    for ids, full in walk_extend(r, msgs):
        assert ids == full
    conv = Conversation(tuple(msgs[:60]))
    expected = r.render(conv)
    prev_ids = r.render(Conversation(tuple(msgs[:58]))) + r.encode(msgs[58].content + "<|im_end|>")
    rendered: list[int] = []
    real = r._render_dicts

    def counting(messages: list[dict[str, Any]], *args: Any) -> str:
        rendered.append(len(messages))
        return real(messages, *args)

    monkeypatch.setattr(r, "_render_dicts", counting)
    assert r.extend(prev_ids, msgs[:59], conv) == expected
    # the first message and two earlier turns, without and with the new one: not all 60
    assert rendered == [3, 4]


def test_a_template_that_numbers_turns_is_not_local_and_extend_renders_everything(
    smol_tokenizer: Tokenizer,
) -> None:
    r = custom(smol_tokenizer, NUMBERS_TURNS)
    assert r.extends_prefix and not r.renders_locally
    for ids, full in walk_extend(r, long_run(6)):
        assert ids == full
    assert r.decode(walk_extend(r, long_run(6))[-1][0]).endswith(
        "<|im_start|>user 14\nq6<|im_end|>\n<|im_start|>assistant 15\n")
    r.renders_locally = True  # what a window would have numbered instead
    assert walk_extend(r, long_run(6))[-1][0] != walk_extend(r, long_run(6))[-1][1]


def test_a_window_the_template_refuses_falls_back_to_the_whole_history(
    smol_tokenizer: Tokenizer,
) -> None:
    r = custom(smol_tokenizer, WANTS_USER_AFTER_SYSTEM)
    assert r.extends_prefix and not r.renders_locally  # the probe's window was refused
    r.renders_locally = True  # as if the probes had not caught it: the window must still be safe
    for ids, full in walk_extend(r, long_run(6)):
        assert ids == full
