"""Runs one framework example as one recorded RL episode: session, agent, reward, export.

The only file of the zoo that imports relayrl. `main(run)` gives every example the same command
line: with `--gateway URL --admin-key KEY` it uses a running gateway, else it starts one on a
loopback port over the default model. The agent `run(task, *, base_url, api_key, max_tokens,
max_turns, **extra)` is ordinary framework code, called exactly as the trainer calls a workflow's
agent: `base_url` is the session's OpenAI-style base URL (`.../v1`; Anthropic-style clients take
its root, `mathtask.service_root`), `api_key` the session key, and `extra` what else the trainer
passes (its shared `http_client`), which the examples do not need.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from relayrl.client import SessionClient
from relayrl.errors import NotFound
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.models import DEFAULT_MODEL, model_path

Agent = Callable[..., Awaitable[float]]
"""`async def run(task, *, base_url, api_key, max_tokens, max_turns, **extra) -> reward`."""


@dataclass(frozen=True)
class Episode:
    """What one run left at the gateway."""

    session_id: str
    reward: float
    rows: list[dict[str, Any]]
    """The session's exported rows (`individual` style: one per recorded call)."""

    @property
    def trained_tokens(self) -> int:
        """Tokens under the loss mask over all rows (the model's own output)."""
        return sum(sum(r["loss_mask"]) for r in self.rows)


async def episode(gateway_url: str, admin_key: str | None, run: Agent, task: dict[str, Any],
                  max_tokens: int = 64, task_id: str = "zoo", **agent_kwargs: Any) -> Episode:
    """Run `run` on `task` inside a fresh session; reward its last call; export the session."""
    async with SessionClient(gateway_url, admin_key) as gateway:
        handle = await gateway.start_session(task_id=task_id)
        reward = await run(task, base_url=handle.base_url, api_key=handle.api_key,
                           max_tokens=max_tokens, **agent_kwargs)
        with contextlib.suppress(NotFound):  # an agent that made no call has nothing to reward
            await gateway.set_reward(handle, reward)
        await gateway.end_session(handle)
        rows = await gateway.export(handle.session_id, style="individual")
    # claude-agent-sdk 0.2.187 drops the CLI's stdout pipe unclosed: collected once asyncio.run
    # had closed the loop, it raised "Event loop is closed" at exit
    gc.collect()
    await asyncio.sleep(0)
    return Episode(handle.session_id, reward, rows)


def main(run: Agent, description: str, argv: list[str] | None = None) -> Episode:
    """Command line shared by the examples: run one episode and print what was recorded."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--gateway", help="URL of a running gateway (else one starts here)")
    p.add_argument("--admin-key", help="that gateway's admin key")
    p.add_argument("--model", default=DEFAULT_MODEL, help="packaged name or HF directory")
    p.add_argument("--max-tokens", type=int, default=64, help="per model call")
    p.add_argument("--max-turns", type=int, default=4, help="model calls per episode, at most")
    p.add_argument("--question", help="ask this instead of the example question")
    p.add_argument("--answer", help="the right answer to --question")
    args = p.parse_args(argv)
    from mathtask import TASK

    task = TASK
    if args.question:
        task = {"messages": [{"role": "user", "content": args.question}],
                "answer": args.answer or "0"}
    if args.gateway:
        ep = asyncio.run(episode(args.gateway, args.admin_key, run, task, args.max_tokens,
                                max_turns=args.max_turns))
    else:
        admin_key = secrets.token_hex(16)
        config = GatewayConfig(model=model_path(args.model), engine="local", admin_key=admin_key,
                               model_label="default")
        with GatewayThread(build_deps(config)) as gw:
            print(f"gateway at {gw.url}, model {args.model}", flush=True)
            ep = asyncio.run(episode(gw.url, admin_key, run, task, args.max_tokens,
                                     max_turns=args.max_turns))
    print(f"session {ep.session_id}: reward {ep.reward}, {len(ep.rows)} recorded calls, "
          f"{ep.trained_tokens} tokens under the loss mask")
    return ep
