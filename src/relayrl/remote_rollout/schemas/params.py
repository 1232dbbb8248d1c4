"""Sampling parameters the trainer asks the rollout server to use on every LLM call.

Pydantic only. Unknown keys are kept and forwarded to the trainer's completions endpoint.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from relayrl.remote_rollout.schemas.constants import MAX_TOKENS_LIMIT


class SamplingParams(BaseModel):
    """Per-call sampling settings (OpenAI names)."""

    model_config = ConfigDict(extra="allow")

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=512, ge=1, le=MAX_TOKENS_LIMIT)
    """Most tokens one LLM call may sample (the server may lower it to fit `max_tokens_total`)."""
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: bool = False


__all__ = ["SamplingParams"]
