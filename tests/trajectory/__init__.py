"""Helpers for the trajectory tests: a toy renderer and a gateway-like `call`.

The toy renderer has the extension property on purpose (a message renders to the same tokens
wherever it sits), like the real renderers, so segments behave as they do behind the gateway.
"""

from __future__ import annotations

from collections.abc import Sequence

from relayrl.chat.conversation import Conversation, Message, ParsedReply, Tool, ToolCall
from relayrl.trajectory import Interaction, Session
from relayrl.types import FinishReason, GenerateOutput, Timings

BOS, EOT, GEN = 1, 2, 3
ROLE = {"system": 4, "user": 5, "assistant": 6, "tool": 7}


def tok(text: str) -> tuple[int, ...]:
    """Deterministic toy token ids for a text (one per character)."""
    return tuple(10 + (ord(ch) % 500) for ch in text)


def render_message(m: Message) -> tuple[int, ...]:
    """Toy rendering of one message: BOS role content [tool calls] EOT."""
    calls = "".join(f"<{c.name}:{c.arguments}>" for c in m.tool_calls)
    return (BOS, ROLE[m.role], *tok(m.content + calls), EOT)


def render(messages: Sequence[Message]) -> tuple[int, ...]:
    """Toy prompt: every message, then the generation prompt."""
    out: tuple[int, ...] = ()
    for m in messages:
        out += render_message(m)
    return (*out, BOS, GEN)


def call(
    session: Session,
    messages: Sequence[Message],
    reply: str,
    *,
    tool_calls: Sequence[ToolCall] = (),
    tools: Sequence[Tool] = (),
    finish: FinishReason = FinishReason.STOP,
    version: int = 0,
    prompt_override: Sequence[int] | None = None,
    interaction_id: str | None = None,
) -> Interaction:
    """Do what the gateway does for one call: locate, render or extend, generate, record."""
    conv = Conversation(tuple(messages), tuple(tools))
    located = session.locate(conv)
    if prompt_override is not None:
        prompt = tuple(prompt_override)
    elif located.reason is None:
        assert located.parent is not None
        body: tuple[int, ...] = ()
        for m in located.new_messages:
            body += render_message(m)
        prompt = (*located.parent.token_ids, *body, BOS, GEN)
    else:
        prompt = render(conv.messages)
    parsed = ParsedReply(reply, tool_calls=tuple(tool_calls))
    text = reply + "".join(f"<{c.name}:{c.arguments}>" for c in tool_calls)
    ids = [*tok(text)] + ([EOT] if finish == FinishReason.STOP else [])
    output = GenerateOutput(
        output_ids=ids,
        logprobs=[-0.01 * (i + 1) for i in range(len(ids))],
        versions=[version] * len(ids),
        finish_reason=finish,
        timings=Timings(queued_s=0.001, first_token_s=0.01, total_s=0.02),
    )
    interaction = session.new_interaction(
        conversation=conv, reply=parsed, prompt_ids=prompt, output=output,
        parent=located.parent, reason=located.reason, id=interaction_id,
    )
    session.record(interaction)
    return interaction


def sys_msg(text: str = "You are helpful.") -> Message:
    """A system message."""
    return Message("system", text)


def user(text: str) -> Message:
    """A user message."""
    return Message("user", text)


def assistant(text: str, tool_calls: Sequence[ToolCall] = ()) -> Message:
    """An assistant message, as a client echoes it back."""
    return Message("assistant", text, tool_calls=tuple(tool_calls))


def tool_result(call_id: str, text: str) -> Message:
    """A tool result message."""
    return Message("tool", text, tool_call_id=call_id)


def three_turn_session(session: Session) -> list[Interaction]:
    """user -> tool call -> tool result -> answer -> user -> answer (one segment)."""
    tc = ToolCall("call_1", "add", '{"a": 1, "b": 2}')
    h = [sys_msg(), user("add 1 and 2")]
    c1 = call(session, h, "", tool_calls=[tc])
    h += [assistant("", [tc]), tool_result("call_1", "3")]
    c2 = call(session, h, "It is 3.", version=1)
    h += [assistant("It is 3."), user("thanks")]
    c3 = call(session, h, "You are welcome.", version=1)
    return [c1, c2, c3]
