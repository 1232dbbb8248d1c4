"""The wire formats the gateway serves: one `Wire` per front door, each backed by a
`relayrl.chat.wire_*` module that satisfies `relayrl.chat.wire_common.WireFormat`.

A new wire format is a new `relayrl.chat.wire_*` module plus one entry here (and its routes in
`gateway.app`); nothing else in the gateway names a wire module.

May import: `relayrl.chat` only (no FastAPI, no engine, no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.chat import wire_anthropic, wire_openai_chat, wire_openai_responses
from relayrl.chat.wire_common import WireFormat


@dataclass(frozen=True)
class Wire:
    """One front door: a name for logs and the module that speaks it."""

    name: str
    format: WireFormat


OPENAI_CHAT = Wire("openai-chat", wire_openai_chat)
OPENAI_RESPONSES = Wire("openai-responses", wire_openai_responses)
ANTHROPIC = Wire("anthropic-messages", wire_anthropic)
WIRES: tuple[Wire, ...] = (OPENAI_CHAT, OPENAI_RESPONSES, ANTHROPIC)


def interaction_id(reply_id: str | None) -> str | None:
    """The call id inside a reply id: each wire prefixes it (`chatcmpl-`, `resp_`, `msg_`)."""
    for wire in WIRES:
        prefix = wire.format.ID_PREFIX
        if reply_id and reply_id.startswith(prefix):
            return reply_id[len(prefix):]
    return reply_id


__all__ = ["ANTHROPIC", "OPENAI_CHAT", "OPENAI_RESPONSES", "WIRES", "Wire", "interaction_id"]
