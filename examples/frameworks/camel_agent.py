"""The math agent on CAMEL-AI: a `ChatAgent` with two `FunctionTool`s, two ways.

    python examples/frameworks/camel_agent.py            # proxy: over HTTP to a gateway
    python examples/frameworks/camel_agent.py --direct   # direct: a relayrl client object

Proxy way (`run`): the model is CAMEL's own `OpenAICompatibleModel` pointed at the gateway's base
URL with the session key; no relayrl import. Direct way (`run_direct`): CAMEL gets a relayrl
`DirectClient` (an OpenAI client bound to one session of a gateway app in this process) as its
async client; no port, no HTTP server. camel-ai pins an older pydantic than relayrl's other
dependencies, so CI installs it in its own environment (scripts/install_frameworks.sh).
"""

from __future__ import annotations

import sys
from typing import Any

from camel.agents import ChatAgent
from camel.models import OpenAICompatibleModel
from camel.toolkits import FunctionTool
from camel.utils import BaseTokenCounter
from mathtask import INSTRUCTIONS, add, check_answer, multiply, question, service_root


class ByteCounter(BaseTokenCounter):
    """A rough token count (UTF-8 bytes / 4) for CAMEL's context bookkeeping.

    CAMEL's default counter loads a tiktoken encoding from the internet on first use; the gateway
    does the exact counting with the policy's own tokenizer anyway.
    """

    def count_tokens_from_messages(self, messages: list[Any]) -> int:
        """Approximate tokens in `messages`."""
        return sum(len(str(m.get("content") or "").encode()) // 4 + 4 for m in messages)

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes (CAMEL only counts them)."""
        return list(text.encode())

    def decode(self, token_ids: list[int]) -> str:
        """Inverse of `encode`."""
        return bytes(token_ids).decode(errors="replace")


def make_agent(model: OpenAICompatibleModel, max_turns: int) -> ChatAgent:
    """The CAMEL agent: the same whichever way its model reaches the policy."""
    return ChatAgent(system_message=INSTRUCTIONS, model=model,
                     tools=[FunctionTool(add), FunctionTool(multiply)],
                     max_iteration=max_turns)


async def solve(agent: ChatAgent, task: dict[str, Any]) -> float:
    """One step of the agent (CAMEL runs the tool calls inside it); the reward of its answer."""
    response = await agent.astep(question(task))
    return check_answer(response.msg.content if response.msg else "", task["answer"])


async def run(task: dict[str, Any], *, base_url: str, api_key: str, max_tokens: int = 64,
              max_turns: int = 3, **extra: Any) -> float:
    """Proxy way: CAMEL's OpenAI-compatible model over HTTP."""
    model = OpenAICompatibleModel("default", model_config_dict={"max_tokens": max_tokens},
                                  url=service_root(base_url) + "/v1", api_key=api_key,
                                  max_retries=0,
                                  token_counter=ByteCounter())
    return await solve(make_agent(model, max_turns), task)


async def run_direct(task: dict[str, Any], client: Any, max_tokens: int = 64,
                     max_turns: int = 3) -> float:
    """Direct way: `client` is a relayrl `DirectClient`, handed to CAMEL as its async client."""
    model = OpenAICompatibleModel("default", model_config_dict={"max_tokens": max_tokens},
                                  url="http://relayrl.direct/v1", api_key="unused",
                                  token_counter=ByteCounter(),
                                  async_client=client)  # the sync client is never used
    return await solve(make_agent(model, max_turns), task)


def main_direct(max_tokens: int = 64, max_turns: int = 3) -> None:
    """Direct way end to end: gateway app in this process, one session, reward, export."""
    import asyncio
    import secrets

    from mathtask import TASK

    from relayrl.client import DirectClient
    from relayrl.gateway.app import create_app
    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.server import build_deps
    from relayrl.models import DEFAULT_MODEL, model_path

    config = GatewayConfig(model=model_path(DEFAULT_MODEL), engine="local",
                           admin_key=secrets.token_hex(16), model_label="default")
    app = create_app(build_deps(config))

    async def episode() -> None:
        async with await DirectClient.open(app, task_id="camel-direct") as client:
            reward = await run_direct(TASK, client, max_tokens=max_tokens,
                                      max_turns=max_turns)
            client.set_last_reward(reward)
            rows = await client.export_interactions(style="individual")
        trained = sum(sum(r.loss_mask) for r in rows.values())
        print(f"session {client.session.session_id}: reward {reward}, {len(rows)} recorded "
              f"calls, {trained} tokens under the loss mask")

    asyncio.run(episode())


if __name__ == "__main__":
    if "--direct" in sys.argv:
        import argparse

        p = argparse.ArgumentParser(description="CAMEL, the direct way")
        p.add_argument("--direct", action="store_true")
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--max-turns", type=int, default=3)
        args = p.parse_args()
        main_direct(args.max_tokens, args.max_turns)
    else:
        from harness import main

        main(run, __doc__.splitlines()[0])
