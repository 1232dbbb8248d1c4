"""AReaL's CAMEL workflow (steps 3-5), as written there with relayrl's names: `ArealOpenAI`
is relayrl's DirectClient, and CAMEL's own `OpenAICompatibleModel` takes it as its async client
(relayrl has no CAMEL model class of its own). Runs one episode through relayrl's episode runner
against the gateway at argv[1] and prints the outcome as JSON. Run in `.venv-camel`."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from camel.agents import ChatAgent
from camel.models import OpenAICompatibleModel
from camel_agent import ByteCounter

from relayrl.client import RunEngine, SessionClient
from relayrl.workflow import AsyncRewardWrapper, EpisodeContext, RolloutWorkflow, run_episode
from relayrl.workflow import DirectClient as ArealOpenAI
from relayrl.workflow import GenerationHyperparameters as GenerationHyperparameters

PreTrainedTokenizerFast = Any  # only a type hint here; CAMEL's environment has no transformers


def AReaLOpenAICompatibleModel(openai_client, tokenizer, model_type):
    """CAMEL's own OpenAI-compatible model on the client (CAMEL counts tokens roughly)."""
    return OpenAICompatibleModel("default", url="http://relayrl.direct/v1", api_key="unused",
                                 token_counter=ByteCounter(), async_client=openai_client,
                                 model_config_dict={"max_tokens": 24})


def math_reward_fn(result, answer):
    """Simple reward function: 1.0 if correct, 0.0 otherwise."""
    return 1.0 if result.strip() == answer.strip() else 0.0


class CamelMathAgent:
    def __init__(self, tokenizer: PreTrainedTokenizerFast):
        self.tokenizer = tokenizer
        # Wrap reward function for async execution
        self.async_reward_fn = AsyncRewardWrapper(math_reward_fn)

    async def run_agent(self, data, client: ArealOpenAI):
        # Create agent with AReaL OpenAI-compatible model
        agent = ChatAgent(
            system_message="You are a helpful math assistant.",
            model=AReaLOpenAICompatibleModel(
                openai_client=client, tokenizer=self.tokenizer, model_type="areal"),
        )

        # Run agent
        response = await agent.astep(data["messages"][-1]["content"])
        content = response.msg.content

        # Evaluate reward and set reward on client for RL training
        reward = await self.async_reward_fn(result=content, answer=data["answer"])
        client.set_last_reward(reward)

        return reward


class CamelRLVRWorkflow(RolloutWorkflow):
    def __init__(
        self,
        gconfig: GenerationHyperparameters,
        tokenizer: PreTrainedTokenizerFast,
    ):
        self.gconfig = gconfig
        self.tokenizer = tokenizer

        # Create our agent wrapper
        self.agent = CamelMathAgent(tokenizer=self.tokenizer)

    async def arun_episode(self, engine, data):
        """Run one training episode: collect trajectories and return training data."""
        # Create one client per trajectory (enables parallel collection)
        client = ArealOpenAI(engine=engine, tokenizer=self.tokenizer)

        # Run agents in parallel
        reward = await self.agent.run_agent(data=data, client=client)  # noqa: F841 (as written)

        # Apply reward discounting for multi-turn conversations
        client.apply_reward_discount(turn_discount=0.9)
        # Export interactions with token-level data
        return client.export_interactions(style="individual")


async def main(url: str, admin_key: str) -> None:
    engine = RunEngine(None, SessionClient(url, admin_key=admin_key))  # the gateway only
    workflow = CamelRLVRWorkflow(gconfig=GenerationHyperparameters(), tokenizer=None)
    data = {"messages": [{"role": "user", "content": "Solve: 2 + 2 = ?"}], "answer": "4"}
    ctx = EpisodeContext(task_id="0", episode_id="ep-camel", group_id="grp-camel")
    outcome = await run_episode(workflow, engine, data, ctx, timeout_s=120)
    rows = list((outcome.result or {}).values())
    print(json.dumps({"status": str(outcome.status), "error": outcome.error,
                      "rewards": [r.reward for r in rows],
                      "trained": sum(sum(r.loss_mask) for r in rows)}))
    await engine.sessions.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
