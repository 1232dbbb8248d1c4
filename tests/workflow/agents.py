"""Test agents: plain classes with `run(data, **extra)`, as users write them.

They live at module level, in a module that imports neither torch nor relayrl, so spawned
subprocess workers unpickle them by reference quickly.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any


class ChatAgent:
    """Asks the model once with the async openai client; reward 1.0 if the reply has the answer."""

    def __init__(self, model: str = "relayrl-test") -> None:
        self.model = model

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=extra.get("base_url") or os.environ["OPENAI_BASE_URL"],
                             api_key=extra.get("api_key") or os.environ["OPENAI_API_KEY"],
                             http_client=extra.get("http_client"), max_retries=0)
        reply = await client.chat.completions.create(model=self.model,
                                                     messages=data["messages"])
        text = reply.choices[0].message.content or ""
        return 1.0 if data["answer"] in text else 0.0


class SyncEnvAgent:
    """A synchronous agent reading only the environment (subprocess mode); two calls."""

    def run(self, data: dict[str, Any], **extra: Any) -> dict[str, float]:
        from openai import OpenAI

        client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"],
                        api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
        first = client.chat.completions.create(model="relayrl-test", messages=data["messages"])
        history = [*data["messages"],
                   {"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "Are you sure?"}]
        second = client.chat.completions.create(model="relayrl-test", messages=history)
        return {first.id: 0.25, second.id: 1.0}


class HttpRewardAgent:
    """Sets its own reward over HTTP (set_reward with the session key) and returns None."""

    async def run(self, data: dict[str, Any], **extra: Any) -> None:
        import httpx
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=extra["base_url"], api_key=extra["api_key"],
                             http_client=extra["http_client"], max_retries=0)
        await client.chat.completions.create(model="relayrl-test", messages=data["messages"])
        root = extra["base_url"].split("/s/")[0]
        http: httpx.AsyncClient = extra["http_client"]
        r = await http.post(f"{root}/rl/set_reward", json={"reward": 0.5},
                            headers={"authorization": f"Bearer {extra['api_key']}"})
        r.raise_for_status()


class CrashingAgent:
    """Makes one call, then raises."""

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        await ChatAgent().run(data, **extra)
        raise RuntimeError("tool backend unreachable")


class HangingAgent:
    """Makes one call, then hangs (sync sleep in subprocess mode, async sleep inline)."""

    def __init__(self, sync: bool = False) -> None:
        self.sync = sync

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        await ChatAgent().run(data, **extra)
        if self.sync:
            time.sleep(3600)  # blocks the worker: only killing the process stops it
        await asyncio.sleep(3600)
        return 1.0


class FlakyAgent(ChatAgent):
    """A ChatAgent that crashes after its call when the data says so."""

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        reward = await super().run(data, **extra)
        if data.get("crash"):
            raise RuntimeError("flaky tool failed")
        return reward
