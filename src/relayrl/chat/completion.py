"""Wire-neutral records for one completion call: what the three front doors parse a request into,
and what the one completion path hands back for them to render.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from relayrl.chat.conversation import Conversation, ParsedReply
from relayrl.types import SamplingParams

ReplyFinish = Literal["stop", "length", "tool_calls", "abort"]
"""Why a reply ended, in wire-neutral terms (each wire format maps it to its own names)."""


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed request, whatever wire format it came in."""

    conversation: Conversation
    params: SamplingParams
    model: str = "default"
    n: int = 1
    stream: bool = False
    logprobs: bool = False
    """Return the logprob of each sampled token."""
    include_usage: bool = False
    """Streaming only: send a final usage chunk (OpenAI `stream_options.include_usage`)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    role: str | None = None
    """The agent role the call is recorded under (the gateway resolves it; None: no role)."""


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token as the wire formats show it."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Choice:
    """One sampled reply."""

    index: int
    reply: ParsedReply
    finish_reason: ReplyFinish
    interaction_id: str
    """The id under which the call is recorded in its session (set_reward takes it)."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    output_tokens: int = 0
    stop_sequence: str | None = None
    """The stop string that ended the reply, if one did (Anthropic reports it as `stop_sequence`)."""


@dataclass(frozen=True)
class Completion:
    """The result of one call, before it is rendered into a wire format."""

    id: str
    model: str
    created: int
    choices: tuple[Choice, ...]
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        """Sampled tokens over all choices."""
        return sum(c.output_tokens for c in self.choices)
