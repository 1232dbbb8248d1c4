"""Small records shared by every layer: what is asked of an engine and what it gives back.

These sit at the bottom of the import graph (they import nothing of ours and no torch), so the
gateway, the trajectory layer and the engines can all speak in them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

PROMPT_VERSION = -1
"""Version recorded for tokens the policy did not sample (prompt, tool results, template glue)."""


class FinishReason(StrEnum):
    """Why an engine stopped producing tokens for one request."""

    STOP = "stop"
    """A stop token id or stop string was produced (end of turn)."""
    LENGTH = "length"
    """`max_new_tokens` or the context length was reached."""
    ABORT = "abort"
    """The request was cancelled (client gone, engine shut down)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion."""

    max_new_tokens: int = 256
    """Upper bound on sampled tokens; must be > 0."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 turns top-k off."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the completion (they are kept in the output, as sampled)."""
    stop: tuple[str, ...] = ()
    """Strings that end the completion once the decoded output contains one."""
    seed: int | None = None
    top_logprobs: int = 0
    """How many alternatives to report per sampled token (0 = none)."""


@dataclass(frozen=True)
class GenerateRequest:
    """Token-in request to an engine."""

    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tokenizer_ids: bool = False
    """The prompt ids came from the model's own tokenizer or were sampled by the engine (the
    gateway's prompts), so they are in the vocabulary: engines skip the per-token range check."""


@dataclass(frozen=True)
class Timings:
    """Wall-clock seconds measured by the engine for one request."""

    queued_s: float = 0.0
    """From submission to the first forward pass that included the request."""
    first_token_s: float = 0.0
    """From submission to the first sampled token."""
    total_s: float = 0.0
    """From submission to the last sampled token."""


@dataclass(frozen=True)
class TopLogprob:
    """One alternative token and its logprob at a sampled position."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenChunk:
    """Tokens sampled since the previous chunk of a streamed request.

    `finish_reason` is set on the last chunk only. Lists are aligned: one entry per token.
    """

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[TopLogprob]] | None = None
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    """The stop string that ended the request, if one did."""
    timings: Timings | None = None
    """Set on the last chunk."""


@dataclass(frozen=True)
class GenerateOutput:
    """Token-out result of an engine: exactly what was sampled, aligned per token.

    `logprobs[i]` is the logprob of `output_ids[i]` under the temperature-scaled distribution
    before top-p/top-k truncation; `versions[i]` is the weight version that sampled it.
    """

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    timings: Timings = field(default_factory=Timings)
    top_logprobs: list[list[TopLogprob]] | None = None
    stop_string: str | None = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"misaligned output: {n} ids, {len(self.logprobs)} logprobs, "
                f"{len(self.versions)} versions"
            )

    @classmethod
    def from_chunks(cls, chunks: Sequence[TokenChunk]) -> GenerateOutput:
        """Join the chunks of a streamed request into one output."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        tops: list[list[TopLogprob]] | None = None
        for c in chunks:
            ids += c.ids
            logprobs += c.logprobs
            versions += c.versions
            if c.top_logprobs is not None:
                tops = (tops or []) + c.top_logprobs
        last = chunks[-1] if chunks else None
        return cls(
            output_ids=ids,
            logprobs=logprobs,
            versions=versions,
            finish_reason=(last.finish_reason if last and last.finish_reason else FinishReason.ABORT),
            timings=(last.timings if last and last.timings else Timings()),
            top_logprobs=tops,
            stop_string=last.stop_string if last else None,
        )
