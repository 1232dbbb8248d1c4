"""A triage agent that hands each question to a specialist: an OpenAI Agents SDK handoff pipeline,
trained per role.

It is ordinary Agents SDK code: two `Agent`s, the triage agent listing the specialist in its
`handoffs`. The one relayrl-specific choice is each agent's `model` name, `default@triage` and
`default@specialist`: with `gateway.roles: true` the gateway records each call under the role
after the `@` (docs/multi-agent.md), so both agents are the one policy being trained, and the
trainer normalises the triage agent's episodes only against the triage agent's, the specialist's
only against the specialist's. The reward (the specialist's final answer, checked) is the
episode's: by the role credit rule every role gets it.

Credit per role: with `per_role=True` (the default) the pipeline sets each role's own reward
when it ends the session (`finalize` with `role_rewards`): the triage agent earns 1 when it handed
the question off by itself, the specialist 1 for the right answer. With `per_role=False` it
returns the answer's reward, and the role credit rule gives it to both roles.

The small default model seldom writes a well-formed tool call, so the triage agent's tool choice
names the handoff (the gateway starts the call in the prompt; the model writes its arguments),
and when the model still gets the handoff wrong the pipeline hands the question to the
specialist itself: every episode has both roles, and the triage agent is rewarded only for the
handoffs it made.
"""

from __future__ import annotations

import os
import re
from typing import Any

import httpx
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    set_tracing_disabled,
)
from agents.handoffs import Handoff
from openai import AsyncOpenAI

TRIAGE = ("You are the triage agent of a help desk. Hand every arithmetic question to the "
          "specialist: call transfer_to_specialist with no arguments, like this: "
          '{"name": "transfer_to_specialist", "arguments": {}}')
SPECIALIST = "You are an arithmetic specialist. Answer with the final number only."
ROLES = ("triage", "specialist")
"""The roles this pipeline's calls are recorded under."""


def check_answer(text: str, answer: str) -> float:
    """1.0 if the last number in `text` equals `answer`, else 0.0."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", (text or "").replace(",", ""))
    return 1.0 if numbers and float(numbers[-1]) == float(answer) else 0.0


async def finalize(base_url: str, api_key: str, http: httpx.AsyncClient | None, reward: float,
                   role_rewards: dict[str, float]) -> None:
    """End the session with the episode's reward and each role's own (the session API)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    body = {"final_reward": reward, "role_rewards": role_rewards}
    headers = {"authorization": f"Bearer {api_key}"}
    if http is not None:
        (await http.post(root + "/rl/v1/finalize", json=body, headers=headers)).raise_for_status()
        return
    async with httpx.AsyncClient(timeout=60) as own:
        (await own.post(root + "/rl/v1/finalize", json=body, headers=headers)).raise_for_status()


class HandoffPipeline:
    """Triage agent -> specialist on one arithmetic question; `run` returns the reward."""

    def __init__(self, model: str = "default", max_tokens: int = 24, max_turns: int = 4,
                 temperature: float = 1.0, per_role: bool = True) -> None:
        self.model = model
        self.per_role = per_role
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.temperature = temperature
        self.counts = {"episodes": 0.0, "handoffs": 0.0}

    def agents(self, client: AsyncOpenAI) -> Agent[Any]:
        """The triage agent, with the specialist as its handoff; each names its role."""
        settings = ModelSettings(max_tokens=self.max_tokens, temperature=self.temperature)
        specialist: Agent[Any] = Agent(
            name="specialist", instructions=SPECIALIST, model_settings=settings,
            model=OpenAIChatCompletionsModel(model=f"{self.model}@specialist",
                                             openai_client=client))
        return Agent(
            name="triage", instructions=TRIAGE, handoffs=[specialist],
            model=OpenAIChatCompletionsModel(model=f"{self.model}@triage", openai_client=client),
            model_settings=ModelSettings(max_tokens=self.max_tokens,
                                         temperature=self.temperature,
                                         tool_choice=Handoff.default_tool_name(specialist)))

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float | None:
        """Route `data["messages"]` through triage to the specialist; reward each role."""
        set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI
        base_url = extra_kwargs.get("base_url") or os.environ["OPENAI_BASE_URL"]
        api_key = extra_kwargs.get("api_key") or os.environ["OPENAI_API_KEY"]
        http = extra_kwargs.get("http_client")
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http, max_retries=0)
        triage = self.agents(client)
        self.counts["episodes"] += 1
        try:
            result = await Runner.run(triage, data["messages"], max_turns=self.max_turns)
            handed_off = result.last_agent.name == "specialist"
            if not handed_off:  # the pipeline's own fallback: the question still gets an answer
                result = await Runner.run(triage.handoffs[0], data["messages"],  # type: ignore[arg-type]
                                          max_turns=self.max_turns)
        except (MaxTurnsExceeded, ModelBehaviorError):
            return 0.0  # no answer: a failed episode, not a broken one
        finally:
            if http is None:
                await client.close()
        self.counts["handoffs"] += handed_off
        correct = check_answer(str(result.final_output), str(data["answer"]))
        if not self.per_role:
            return correct  # the episode's reward, which every role gets
        # each role its own reward: the triage agent is right when it handed off by itself
        await finalize(base_url, api_key, http, correct,
                       {"triage": float(handed_off), "specialist": correct})
        return None  # the rewards are set


    def counters(self) -> dict[str, float]:
        """Episodes run and episodes the triage agent handed off (cumulative)."""
        return dict(self.counts)
