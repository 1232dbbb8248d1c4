"""The gateway's render cache: a hit is always what a fresh render gives; it stays bounded."""

from __future__ import annotations

from dataclasses import replace

from relayrl.chat.conversation import Conversation, Message, Tool, ToolCall
from relayrl.chat.renderer import Renderer
from relayrl.gateway.core import RenderCache


def conv(text: str, **kw) -> Conversation:
    return Conversation((Message(role="system", content="Be brief."),
                         Message(role="user", content=text)), **kw)


def test_an_identical_conversation_hits_and_gets_the_fresh_render(model_dir: str) -> None:
    r = Renderer.from_pretrained(model_dir)
    cache = RenderCache()
    c = conv("What is 2 + 2?")
    first, second = cache.render(r, c), cache.render(r, conv("What is 2 + 2?"))
    assert first == second == r.render(c)
    assert (cache.hits, cache.misses) == (1, 1)


def test_anything_the_template_reads_makes_a_different_key(model_dir: str) -> None:
    r = Renderer.from_pretrained(model_dir)
    cache = RenderCache()
    base = conv("q")
    tool = Tool(name="add", description="Add.", parameters={"type": "object"})
    call = Message(role="assistant", content="", tool_calls=(ToolCall("c1", "add", '{"a":1}'),))
    variants = [
        base,
        conv("q "),  # whitespace matters to the template, unlike to the session's parent lookup
        conv("q", tools=(tool,)),
        conv("q", template_kwargs={"enable_thinking": True}),
        replace(base, messages=(*base.messages, call)),
        replace(base, messages=(*base.messages,
                                replace(call, tool_calls=(ToolCall("c1", "add", '{"a": 1}'),)))),
    ]
    for v in variants:
        assert cache.render(r, v) == r.render(v)
    assert cache.misses == len(variants) and cache.hits == 0


def test_the_cache_evicts_to_stay_within_its_token_budget(model_dir: str) -> None:
    r = Renderer.from_pretrained(model_dir)
    cache = RenderCache(max_tokens=200, max_entries=1000)
    for i in range(50):
        cache.render(r, conv(f"question number {i}"))
    assert 0 < len(cache) < 50
    assert sum(len(cache.render(r, conv("question number 49"))) for _ in range(1)) > 0
    assert cache.hits == 1  # the most recent entry survived eviction


def agent_history(turns: int, last: str) -> tuple[Message, ...]:
    """A system prompt, a question, `turns` tool-call rounds and plain exchanges, then `last`."""
    msgs = [Message("system", "You add numbers."), Message("user", "What is 1 + 2 + ... ?")]
    for i in range(turns):
        call = ToolCall(f"call_{i}", "add", f'{{"a": {i}, "b": 1}}')
        msgs += [Message("assistant", "", tool_calls=(call,)),
                 Message("tool", str(i + 1), tool_call_id=f"call_{i}", name="add"),
                 Message("assistant", f"So far {i + 1}."), Message("user", f"Go on ({i}).")]
    return (*msgs, Message("user", last))


ADD = Tool(name="add", description="Add two numbers.", parameters={
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}})


def test_a_long_history_resent_with_a_new_last_turn_renders_only_that_turn(
    model_dir: str, monkeypatch,
) -> None:
    r = Renderer.from_pretrained(model_dir)
    assert r.renders_locally
    cache = RenderCache()
    for i in range(5):
        c = Conversation(agent_history(12, f"and now {i}?"), tools=(ADD,))
        assert cache.render(r, c) == r.render(c)
    assert (cache.hits, cache.misses, cache.head_hits) == (0, 5, 4)
    rendered: list[int] = []
    real = r._render_dicts

    def counting(messages, *args):
        rendered.append(len(messages))
        return real(messages, *args)

    monkeypatch.setattr(r, "_render_dicts", counting)
    c = Conversation(agent_history(12, "one more?"), tools=(ADD,))
    ids = cache.render(r, c)
    monkeypatch.undo()
    assert ids == r.render(c) and cache.head_hits == 5
    assert max(rendered) < 6  # a window around the new turn, not the 50-message history


def test_a_head_that_differs_in_one_character_is_not_reused(model_dir: str) -> None:
    r = Renderer.from_pretrained(model_dir)
    cache = RenderCache()
    history = agent_history(6, "next?")
    cache.render(r, Conversation(history))
    edited = list(history)
    edited[3] = replace(edited[3], content=edited[3].content + " ")
    last_reply = replace(history[-3], content="So far 6!")  # the last assistant turn, edited
    for messages in (tuple(edited), (*history[:-3], last_reply, *history[-2:])):
        c = Conversation(messages)
        assert cache.render(r, c) == r.render(c)
    assert cache.head_hits == 0
    c = Conversation(history, tools=(ADD,))  # the same messages, other tools: another head
    assert cache.render(r, c) == r.render(c) and cache.head_hits == 0


def test_a_template_that_is_not_local_never_takes_the_head_path(model_dir: str) -> None:
    from tokenizers import Tokenizer

    numbered = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ loop.index }}\n{{ m.content }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant "
                "{{ messages | length + 1 }}\n{% endif %}")
    r = Renderer(Tokenizer.from_file(f"{model_dir}/tokenizer.json"), {"default": numbered},
                 {"eos_token": "<|im_end|>"})
    assert r.extends_prefix and not r.renders_locally
    cache = RenderCache()
    for i in range(3):
        c = Conversation(agent_history(4, f"q{i}"))
        assert cache.render(r, c) == r.render(c)
    assert cache.head_hits == 0


async def test_the_gateway_tells_the_engine_its_prompt_ids_come_from_the_tokenizer(
    model_dir: str,
) -> None:
    from relayrl.chat.completion import CompletionRequest
    from relayrl.engine.fake import FakeEngine
    from relayrl.gateway import core
    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.server import build_deps
    from relayrl.types import SamplingParams

    engine = FakeEngine(["Four."], tokenizer_path=model_dir)
    deps = build_deps(GatewayConfig(model=model_dir, engine="fake", admin_key="k" * 32),
                      engine=engine)
    req = CompletionRequest(conversation=conv("What is 2 + 2?"),
                            params=SamplingParams(max_new_tokens=8))
    await core.complete(deps, None, req)
    sent = engine.requests[-1]
    assert sent.tokenizer_ids and max(sent.prompt_ids) < engine.vocab_size
