"""Grouped math episodes through a rollout server running as a separate process.

    python examples/remote_rollout/run_episodes.py --groups 2 --group-size 2
    python examples/remote_rollout/run_episodes.py --engine fake    # seconds, no model

Starts `relayrl rollout-server` (the reference calculator agent) as a child process, a gateway
on loopback over the default model, and asks a `RolloutController` running
`RemoteRolloutWorkflow` for one batch: the batch a trainer with `workflow: remote` would train
on. Prints rewards per group and the gateway's response_mask checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from relayrl.client import SessionClient
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.server import GatewayThread, build_deps
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.remote_rollout.workflow import RemoteRolloutConfig, RemoteRolloutWorkflow
from relayrl.rollout import Batch, RolloutConfig, RolloutController

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reward import math_reward  # noqa: E402  (the example's folder is not a package)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--engine", default="local", choices=["local", "fake"])
    p.add_argument("--data", default=str(HERE.parent / "math_agent" / "math.jsonl"))
    p.add_argument("--max-tokens", type=int, default=64, help="per model call")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--server-port", type=int, default=0, help="0: a free port")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per episode")
    return p.parse_args(argv)


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int) -> subprocess.Popen[str]:
    """`relayrl rollout-server` as a child process; returns once /health answers (<= 60 s)."""
    env = {**os.environ, "ROLLOUT_SERVER_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "relayrl.remote_rollout.cli"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, text=True)
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the rollout server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.terminate()
    raise RuntimeError("the rollout server did not answer /health within 60 s")


def load_jsonl(path: str) -> list[dict[str, Any]]:
    """One JSON object per line."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


async def run(args: argparse.Namespace, gateway_url: str, admin_key: str,
              server_url: str) -> tuple[Batch, dict[str, int]]:
    """One batch of grouped remote episodes."""
    rollout = RolloutConfig(group_size=args.group_size, batch_size=args.groups,
                            max_concurrent_rollouts=args.groups * args.group_size,
                            max_staleness=0, episode_timeout_s=args.timeout)
    async with SessionClient(gateway_url, admin_key, timeout_s=args.timeout) as client:
        workflow = RemoteRolloutWorkflow(server_url, client, math_reward, RemoteRolloutConfig(
            sampling={"max_tokens": args.max_tokens, "temperature": 1.0},
            max_turns=args.max_turns))
        from relayrl.workflow import GroupedWorkflow

        grouped = GroupedWorkflow(workflow, args.group_size)
        async with RolloutController(grouped, load_jsonl(args.data), rollout) as controller:
            batch = await controller.next_batch()
        return batch, dict(workflow.stats)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Start the server process and a gateway, run one batch, print and return a summary."""
    args = parse_args(argv)
    port = args.server_port or free_port()
    server = start_server(port)
    try:
        path = model_path(args.model)
        admin_key = secrets.token_hex(16)
        n = args.groups * args.group_size
        config = GatewayConfig(model=path, engine=args.engine, admin_key=admin_key,
                               batch_size=n, max_staleness=100)
        with GatewayThread(build_deps(config)) as gw:
            print(f"gateway at {gw.url}; rollout server at http://127.0.0.1:{port}", flush=True)
            start = time.monotonic()
            batch, stats = asyncio.run(run(args, gw.url, admin_key, f"http://127.0.0.1:{port}"))
            wall = time.monotonic() - start
    finally:
        server.terminate()
        server.wait(10)
    rewards = list(batch.rows.rewards)
    summary = {"episodes": batch.stats.accepted, "rows": batch.num_rows,
               "reward_mean": sum(rewards) / max(1, len(rewards)), "wall_s": round(wall, 1),
               **{f"workflow_{k}": v for k, v in sorted(stats.items())}}
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
