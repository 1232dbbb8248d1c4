"""Toy workflows and tensor dicts for the workflow and rollout tests (agents: `agents.py`)."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from relayrl.workflow import RolloutWorkflow
from relayrl.workflow import workflow_context as wc


def make_td(rows: int, seqlen: int, reward: float = 1.0, prompt_len: int = 2,
            version: int = 0, first_token: int = 1) -> dict[str, torch.Tensor]:
    """A valid tensor dict: `prompt_len` prompt tokens, the rest sampled at `version`."""
    ids = torch.arange(first_token, first_token + seqlen, dtype=torch.int32).repeat(rows, 1)
    loss = torch.zeros(rows, seqlen, dtype=torch.int32)
    loss[:, prompt_len:] = 1
    versions = torch.full((rows, seqlen), -1, dtype=torch.int32)
    versions[:, prompt_len:] = version
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(rows, seqlen, dtype=torch.bool),
        "loss_mask": loss,
        "logprobs": -0.5 * loss.float(),
        "versions": versions,
        "rewards": torch.full((rows,), reward, dtype=torch.float32),
    }


class LengthWorkflow(RolloutWorkflow):
    """One row whose length and reward come from the data; records the contexts it saw."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.seen: list[wc.EpisodeContext] = []

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        ctx = wc.get()
        await asyncio.sleep(self.delay_s)
        assert wc.get() == ctx  # no other episode's context leaks in across an await
        self.seen.append(ctx)
        seqlen = data.get("seqlen", 4) + ctx.sample_index
        return make_td(1, seqlen, reward=float(data.get("reward", ctx.sample_index)))


class ScriptedWorkflow(RolloutWorkflow):
    """Each episode does what `data["plan"][sample_index]` says: ok, none, raise, hang."""

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        what = data["plan"][wc.get().sample_index % len(data["plan"])]
        if what == "none":
            return None
        if what == "raise":
            raise ValueError("agent crashed on purpose")
        if what == "hang":
            await asyncio.sleep(3600)
        if what == "bad":
            return {"input_ids": torch.zeros(1, 3, dtype=torch.int64),
                    "attention_mask": torch.ones(1, 3, dtype=torch.bool)}
        return make_td(1, 5, reward=1.0)
