"""Run grouped episodes of the math agent through a local gateway; print rewards, write dumps.

    RELAYRL_HOME=/tmp/rr python examples/math_agent/run_episodes.py --groups 2 --group-size 4

Starts a gateway on a loopback port over the default model (in-process `LocalEngine`), resolves
`MathAgent` into an `AgentWorkflow`, and asks a `RolloutController` for one batch of `--groups`
complete groups. Each episode is a real openai-agents run whose every model call the gateway
records token by token; the batch is what a trainer would get.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
from pathlib import Path
from typing import Any

from relayrl.client import SessionClient
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.rollout import Batch, RolloutConfig, RolloutController
from relayrl.workflow import AgentConfig, AgentMode, resolve_workflow, tokenizer_decoder

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=2, help="groups in the batch")
    p.add_argument("--group-size", type=int, default=4, help="episodes per question")
    p.add_argument("--model", default=DEFAULT_MODEL, help="packaged name or HF directory")
    p.add_argument("--engine", default="local", choices=["local", "fake"])
    p.add_argument("--data", default=str(HERE / "math.jsonl"), help="JSONL: messages, answer")
    p.add_argument("--mode", default=str(AgentMode.INLINE), choices=[str(m) for m in AgentMode])
    p.add_argument("--max-tokens", type=int, default=96, help="per model call")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per episode")
    p.add_argument("--dump-root", default="/tmp/relayrl-dumps", help="trajectory dumps go here")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_jsonl(path: str) -> list[dict[str, Any]]:
    """The dataset: one JSON object per line."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


async def run_episodes(args: argparse.Namespace, gateway_url: str, admin_key: str,
                       model_label: str, decode: Any = None) -> Batch:
    """One batch of `args.groups` groups from the math dataset."""
    config = RolloutConfig(group_size=args.group_size, batch_size=args.groups,
                           max_concurrent_rollouts=args.groups * args.group_size,
                           max_staleness=0, episode_timeout_s=args.timeout,
                           agent=AgentConfig(mode=args.mode),
                           seed=args.seed, dump_root=args.dump_root, experiment="math_agent",
                           trial="example")
    async with SessionClient(gateway_url, admin_key) as gateway:
        workflow = resolve_workflow("agent.MathAgent",
                                    {"model": model_label, "max_tokens": args.max_tokens},
                                    gateway=gateway, agent_config=config.agent_config())
        async with RolloutController(workflow, load_jsonl(args.data), config,
                                     decode=decode) as controller:
            return await controller.next_batch()


def report(batch: Batch, dump_root: str) -> None:
    """Print rewards per group and where the dumps are."""
    rewards = list(batch.rows.rewards)
    start = 0
    for task_id, size in zip(dict.fromkeys(batch.task_ids), batch.group_sizes, strict=True):
        group = rewards[start:start + size]
        print(f"task {task_id}: rewards {group} (mean {sum(group) / len(group):.2f})")
        start += size
    s = batch.stats
    print(f"episodes: {s.accepted} finished, {s.rejected} rejected, {s.aborted} aborted; "
          f"rows {batch.num_rows}, tokens/row up to {batch.rows.max_tokens}")
    for err in s.recent_errors:
        print(f"  aborted: {err}")
    for task_id in dict.fromkeys(batch.task_ids):
        for path in sorted(Path(dump_root, "math_agent", "example").glob(f"*/*/{task_id}.jsonl")):
            print(f"dump: {path}")


def main(argv: list[str] | None = None) -> None:
    """Start a gateway, run the episodes, print the rewards."""
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))  # so "agent.MathAgent" resolves (and unpickles in workers)
    path = model_path(args.model)
    admin_key = secrets.token_hex(16)
    label = "math-policy"
    n = args.groups * args.group_size
    # the controller enforces the staleness rule; the gateway's own count also includes
    # sessions that were aborted, so its limit is kept loose here
    config = GatewayConfig(model=path, engine=args.engine, admin_key=admin_key,
                           model_label=label, batch_size=n, max_staleness=100)
    with GatewayThread(build_deps(config)) as gw:
        print(f"gateway at {gw.url}, model {args.model} ({args.engine} engine)", flush=True)
        batch = asyncio.run(run_episodes(args, gw.url, admin_key, label,
                                         decode=tokenizer_decoder(path)))
    report(batch, args.dump_root)


if __name__ == "__main__":  # the guard subprocess mode needs: workers re-import this file
    main()
