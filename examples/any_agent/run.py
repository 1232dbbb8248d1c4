"""The math agent trained through `relayrl serve`, driven from this separate process.

The agent is the unchanged openai-agents MathAgent of examples/math_agent. This script is what a
user of the service writes: it starts nothing of relayrl's in-process; it runs episodes with
`AgentRunner` (every call of an episode lands in its own session, rewards are the agent's return
values) and reads `/rl/v1/status`. For the demo it also starts the service as a child process and
measures held-out reward before and after (unrecorded calls with the admin key).

    python examples/any_agent/run.py [--steps 12] [--group-size 8] [--eval-items 48] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "math_agent"))

from agent import MathAgent  # noqa: E402

from relayrl.client import AgentRunner  # noqa: E402


def load(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """JSONL items."""
    items = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return items[:limit] if limit else items


class Service:
    """`relayrl serve` in a child process; its URL, admin key and status."""

    def __init__(self, overrides: list[str], log: Path, timeout_s: float = 1800.0) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "relayrl.cli", "serve", str(HERE / "serve.yaml"), *overrides]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s  # loading the model, before it listens
        # it prints its URL, then the lines that point agents at it (the key read from its file)
        while "export RELAYRL_URL" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the service did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        line = next(x for x in log.read_text().splitlines() if "listening at" in x)
        self.url = line.rsplit(" ", 1)[-1]
        exports = [x for x in log.read_text().splitlines() if x.startswith("export ")]
        shell = "\n".join([*exports, 'printf %s "${RELAYRL_API_KEY:-}"'])
        self.admin_key = subprocess.run(["bash", "-c", shell], capture_output=True, text=True,
                                        check=True, timeout=30).stdout

    def status(self) -> dict[str, Any]:
        """`GET /rl/v1/status`."""
        return httpx.get(f"{self.url}/rl/v1/status", timeout=30).json()

    def wait_for(self, done: Any, what: str, timeout_s: float) -> dict[str, Any]:
        """Block until `done(status)` holds (bounded by `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.status()
            if done(s):
                return s
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited:\n{self.log.read_text()[-3000:]}")
            time.sleep(1.0)
        raise TimeoutError(f"not {what} within {timeout_s} s: {self.status()}")

    def wait_for_batches(self, batches: int, timeout_s: float) -> dict[str, Any]:
        """Block until the trainer has consumed `batches` batches (bounded).

        Batches, not optimizer steps: a batch whose groups all got one reward carries no signal
        and takes no step (it still moves the version on).
        """
        return self.wait_for(lambda s: s["trainer"]["batches"] >= batches,
                             f"{batches} batches", timeout_s)

    def wait_until_training(self, timeout_s: float) -> dict[str, Any]:
        """Block until the service's warm-start is over (it listens from the start, but admits
        sessions only once the trainer takes batches)."""
        return self.wait_for(lambda s: s["trainer"]["phase"] == "training", "warmed up",
                             timeout_s)

    def stop(self) -> str:
        """SIGTERM, wait, and return the service's output."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(600)
        return self.log.read_text()


async def evaluate(url: str, admin_key: str, items: list[dict[str, Any]],
                   max_tokens: int) -> float:
    """Mean greedy reward; the admin key's calls are served but not recorded (not trained on)."""
    agent = MathAgent(max_tokens=max_tokens, max_turns=4, temperature=0.0)
    sem = asyncio.Semaphore(8)

    async def one(item: dict[str, Any]) -> float:
        async with sem:
            return await agent.run(item, base_url=f"{url}/v1", api_key=admin_key)

    rewards = await asyncio.gather(*(one(i) for i in items))
    return sum(rewards) / len(rewards)


async def train(url: str, svc: Service, items: list[dict[str, Any]], args: argparse.Namespace,
                ) -> None:
    """Episodes in groups until the service has trained on `args.steps` batches."""
    # The agent reads its endpoint from the environment, as agents do; inside each AgentRunner
    # episode its calls are routed into that episode's session whatever key it sends.
    os.environ["OPENAI_BASE_URL"] = f"{url}/v1"
    os.environ.setdefault("OPENAI_API_KEY", "routed-by-relayrl")
    agent = MathAgent(max_tokens=args.max_tokens, max_turns=4, temperature=1.0)
    runner = AgentRunner(base_url=url, api_key=svc.admin_key, group_size=args.group_size,
                         concurrency=args.concurrency, progress=False, timeout_s=600.0)
    per_step = args.batch_size
    for step in range(args.steps):  # bounded: one round of items per step
        chunk = [items[(step * per_step + j) % len(items)] for j in range(per_step)]
        summary = await runner.run(agent.run, chunk)
        status = svc.status()
        t = status["trainer"]
        print(f"round {step + 1}: {summary.finished} finished, {summary.aborted} aborted, "
              f"mean reward {summary.mean_reward}; trainer: {t['batches']} batches, "
              f"{t['step']} optimizer steps", flush=True)
        if t["batches"] >= args.steps:
            break
    await asyncio.to_thread(svc.wait_for_batches, args.steps, args.step_timeout_s)


def main(argv: list[str] | None = None) -> None:
    """Warm-up traces, the service, eval, training from this process, eval, stop."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2, help="items (groups) per step")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--eval-items", type=int, default=48)
    p.add_argument("--sft-rows", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--fileroot", default="runs")
    p.add_argument("--trial", default="main")
    p.add_argument("--seed", type=int, default=1, help="the service's seed (sampling, SFT order)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--step-timeout-s", type=float, default=1800.0)
    args = p.parse_args(argv)
    started = time.perf_counter()
    train_items = load(HERE.parent / "math_agent" / "train.jsonl")
    eval_items = load(HERE.parent / "math_agent" / "eval.jsonl", args.eval_items)
    run_dir = Path(args.fileroot) / "any_agent" / args.trial
    traces = run_dir / "warmup_traces.jsonl"
    if not traces.exists():
        from teacher import generate_traces

        from relayrl.models import model_path

        print(f"generating {args.sft_rows} warm-up traces with the scripted teacher ...", flush=True)
        traces.parent.mkdir(parents=True, exist_ok=True)
        generate_traces(model_path("smollm2-135m-instruct"), train_items[-args.sft_rows:],
                        args.sft_rows, out_path=traces)
    overrides = [f"fileroot={args.fileroot}", f"trial_name={args.trial}", f"seed={args.seed}",
                 f"sft.data={traces}",
                 f"sft.max_rows={args.sft_rows}", f"gateway.port={args.port}",
                 f"rollout.group_size={args.group_size}", f"rollout.batch_size={args.batch_size}"]
    svc = Service(overrides, run_dir / "serve.log")
    try:
        svc.wait_until_training(args.step_timeout_s)
        before = asyncio.run(evaluate(svc.url, svc.admin_key, eval_items, args.max_tokens))
        print(f"held-out reward before RL (after the service's warm-start): {before:.3f}",
              flush=True)
        asyncio.run(train(svc.url, svc, train_items, args))
        after = asyncio.run(evaluate(svc.url, svc.admin_key, eval_items, args.max_tokens))
    finally:
        out = svc.stop() if svc.proc.poll() is None else svc.log.read_text()
    status_line = next((x for x in out.splitlines() if x.startswith("relayrl: held-out")), "")
    print(f"held-out reward before RL {before:.3f} -> after {args.steps} batches {after:.3f} over "
          f"{len(eval_items)} items; {(time.perf_counter() - started) / 60:.1f} min")
    if status_line:
        print(f"service: {status_line}")


if __name__ == "__main__":
    main()
