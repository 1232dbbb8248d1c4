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
