"""The response_mask bookkeeping of `RolloutSession` (the protocol's walk-through)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from relayrl.chat.conversation import Conversation, Message, ToolCall
from relayrl.chat.renderer import Renderer
from relayrl.remote_rollout.schemas import Message as WireMessage
from relayrl.remote_rollout.session import RolloutSession
from relayrl.remote_rollout.tokenizer import TemplateTokenizer
from relayrl.remote_rollout.tools import Calculator

from .conftest import tool_call_text


class CountingTokenizer:
    """The protocol's abstract walk-through: 5 prompt tokens, then 13 once the reply and tool joined."""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], tools=None,
                            add_generation_prompt: bool = True) -> list[int]:
        return list(range(1, {2: 6, 4: 14}[len(messages)]))


def test_seed_walkthrough_numbers() -> None:
    s = RolloutSession("r1", [WireMessage(role="system", content="s"),
                              WireMessage(role="user", content="u")], CountingTokenizer(), None,
                       "http://127.0.0.1:1")
    mask, length = s.next_mask()
    assert (mask, length) == (None, 5)
    s.record_reply(length, [6, 7, 8, 9, 10])
    assert s.last_prompt_length == 10
    s.messages += [WireMessage(role="assistant", content="a"), WireMessage(role="tool",
                                                                           content="t")]
    mask, length = s.next_mask()
    assert (mask, length) == ([0, 0, 0], 13)
    s.record_reply(length, [14, 15, 16])
    assert s.last_prompt_length == 16


def test_mask_on_the_real_tokenizer_covers_exactly_the_tool_turn(model_dir: str) -> None:
    tok = TemplateTokenizer.from_dir(model_dir)
    tools = Calculator().definitions()
    msgs = [WireMessage(role="system", content="You are a calculator."),
            WireMessage(role="user", content="What is 15 * 23?")]
    s = RolloutSession("r1", msgs, tok, None, "http://127.0.0.1:1", tools=tools)
    mask, length = s.next_mask()
    assert mask is None
    # the model's reply, as the gateway returns its sampled ids (end-of-turn token included)
    reply = tool_call_text("multiply", a=15, b=23)
    renderer = Renderer.from_pretrained(model_dir)
    token_ids = renderer.encode(reply + "<|im_end|>")
    s.record_reply(length, token_ids)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "multiply", "arguments": '{"a": 15, "b": 23}'}}
    s.messages += [WireMessage(role="assistant", content=None, tool_calls=[call]),
                   WireMessage(role="tool", content="345", tool_call_id="call_1",
                               name="multiply")]
    mask, length2 = s.next_mask()
    assert mask is not None and set(mask) == {0}
    full = tok.apply_chat_template([m.to_wire() for m in s.messages],
                                   [t.model_dump() for t in tools])
    assert tok.decode(full[len(full) - len(mask):]) == (
        "\n<|im_start|>user\n<tool_response>\n345\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # the gateway's own incremental prompt adds exactly as many tokens after prompt + reply
    conv1 = Conversation(messages=(Message("system", "You are a calculator."),
                                   Message("user", "What is 15 * 23?")),
                         tools=tuple(_tools(tools)))
    prompt1 = renderer.render(conv1)
    assert len(prompt1) == length
    assistant = Message("assistant", "", tool_calls=(ToolCall("call_1", "multiply",
                                                              '{"a":15,"b":23}'),))
    conv2 = Conversation(messages=(*conv1.messages, assistant,
                                   Message("tool", "345", tool_call_id="call_1",
                                           name="multiply")), tools=conv1.tools)
    extended = renderer.extend([*prompt1, *token_ids], (*conv1.messages, assistant), conv2)
    assert extended is not None and len(extended) == length2
    assert len(extended) - len(prompt1) - len(token_ids) == len(mask)


def _tools(defs):
    from relayrl.chat.conversation import Tool

    return [Tool(name=d.function.name, description=d.function.description,
                 parameters=d.function.parameters) for d in defs]
