"""SFT warm-up traces for the remote math task, in the calculator server's own tool format.

    python examples/remote_rollout/calc_teacher.py --n 96 --out /tmp/remote_traces.jsonl

The untrained 135M model writes no tool calls when the calculator's tools are in its system
prompt, so every RL group scores 0 and nothing is learned. These traces teach the format first.

How a trace is made: the rollout server (the real `relayrl.remote_rollout` calculator agent, its
tools from its own `GET /tools`) runs each episode against a real gateway on loopback whose
engine is a `FakeEngine` scripted by the math example's teacher (`examples/math_agent/teacher.py`:
it reads the rendered prompt and writes the next correct `<tool_call>`, or the final answer once
every tool result is in). So the gateway renders the prompt, the tool list and every tool result
exactly as it will during RL, the server parses and executes the calls, and the exported row (one
`concat` row per episode: prompt + replies + tool results, loss on the replies) holds the very
tokens the trained model will be asked to produce. Every trace must be rewarded 1.0 by the
example's reward and pass the gateway's response_mask check, or generation fails loudly.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
MATH_AGENT = HERE.parent / "math_agent"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from relayrl.errors import EpisodeFailed, InvalidRequest  # noqa: E402

TEACHER_LABEL = "remote-math-teacher"


def math_teacher() -> ModuleType:
    """`examples/math_agent/teacher.py`, loaded by path (its name would clash on sys.path)."""
    name = "relayrl_example_math_teacher"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, MATH_AGENT / "teacher.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while being built
        spec.loader.exec_module(module)
    return sys.modules[name]


async def agenerate_traces(model_dir: str, tasks: Sequence[dict[str, Any]], n: int,
                           server_url: str, out_path: str | Path | None = None,
                           concurrency: int = 4, max_turns: int = 4,
                           max_tokens: int = 64) -> list[dict[str, Any]]:
    """`n` teacher episodes through the rollout server at `server_url`; see `generate_traces`."""
    from reward import math_reward

    from relayrl.client import SessionClient
    from relayrl.engine.fake import FakeEngine
    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.server import GatewayThread, build_deps
    from relayrl.models import model_path
    from relayrl.remote_rollout.workflow import RemoteRolloutConfig, RemoteRolloutWorkflow
    from relayrl.workflow import EpisodeContext, episode_scope

    if n < 0 or (n > 0 and not tasks) or concurrency < 1:
        raise InvalidRequest(f"need n >= 0, some tasks and concurrency >= 1; got {n}, "
                             f"{len(tasks)} tasks, {concurrency}")
    path = model_path(model_dir)
    engine = FakeEngine(math_teacher().teacher_script(path), tokenizer_path=path)
    admin_key = secrets.token_hex(16)
    config = GatewayConfig(model=path, engine="fake", admin_key=admin_key,
                           model_label=TEACHER_LABEL, batch_size=max(n, 1), max_staleness=0)
    gate = asyncio.Semaphore(concurrency)

    async def episode(i: int, workflow: RemoteRolloutWorkflow) -> dict[str, Any]:
        task = tasks[i % len(tasks)]
        async with gate:
            with episode_scope(EpisodeContext(task_id=f"teacher-{i}", episode_id=f"teacher-{i}")):
                rows = await workflow.arun_episode(None, dict(task))
        return _checked_row(i, task, list((rows or {}).values()))

    with GatewayThread(build_deps(config, engine=engine)) as gateway:
        async with SessionClient(gateway.url, admin_key) as client:
            # on_mask_mismatch=drop: a trace whose masks disagree comes back empty and fails
            workflow = RemoteRolloutWorkflow(server_url, client, math_reward, RemoteRolloutConfig(
                sampling={"max_tokens": max_tokens, "temperature": 0.0}, max_turns=max_turns,
                on_mask_mismatch="drop"))
            try:
                rows = await asyncio.gather(*(episode(i, workflow) for i in range(n)))
            finally:
                await workflow.aclose()
    if out_path is not None:
        from relayrl.trajectory import row_from_dict, write_jsonl

        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl((row_from_dict(r) for r in rows), out_path)
    return list(rows)


def generate_traces(model_dir: str, tasks: Sequence[dict[str, Any]], n: int,
                    server_url: str | None = None, out_path: str | Path | None = None,
                    concurrency: int = 4, max_turns: int = 4,
                    max_tokens: int = 64) -> list[dict[str, Any]]:
    """`n` teacher episodes of the calculator agent, one `concat` row each (a `row_to_dict`
    record, rewarded 1.0, masks checked); written as JSONL to `out_path` when given.

    `server_url` names a running rollout server; None starts one as a child process for the
    duration. Tasks are used in turn. Not for a running event loop (await `agenerate_traces`).
    """
    if server_url is not None:
        return asyncio.run(agenerate_traces(model_dir, tasks, n, server_url, out_path,
                                            concurrency, max_turns, max_tokens))
    from run_episodes import free_port, start_server

    port = free_port()
    server = start_server(port)
    try:
        return asyncio.run(agenerate_traces(model_dir, tasks, n, f"http://127.0.0.1:{port}",
                                            out_path, concurrency, max_turns, max_tokens))
    finally:
        server.terminate()
        server.wait(10)


def _checked_row(i: int, task: dict[str, Any], rows: list[Any]) -> dict[str, Any]:
    """The episode's only row, as a dict; anything but one rewarded, mask-clean row fails."""
    from relayrl.trajectory import row_to_dict

    question = task["messages"][-1]["content"]
    if len(rows) != 1:
        raise EpisodeFailed(f"teacher episode {i} ({question!r}) exported {len(rows)} rows, "
                            "expected one concat row (0: its response masks disagreed)")
    (row,) = rows
    summary = row.metadata.get("remote_rollout", {})
    if row.reward != 1.0 or summary.get("mask_mismatches", 0):
        raise EpisodeFailed(f"teacher episode {i} ({question!r}) was rewarded {row.reward} "
                            f"with {summary.get('mask_mismatches')} mask mismatches")
    if not summary.get("metrics", {}).get("num_tool_calls"):
        raise EpisodeFailed(f"teacher episode {i} ({question!r}) made no tool call")
    return row_to_dict(row)


def main(argv: list[str] | None = None) -> None:
    """Generate traces from a task file; print their size and how long they took."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="packaged name or HF dir")
    p.add_argument("--tasks", default=str(MATH_AGENT / "train.jsonl"), help="JSONL: messages, answer")
    p.add_argument("--n", type=int, default=96, help="traces to generate")
    p.add_argument("--out", default=None, help="write the rows here (JSONL)")
    p.add_argument("--server-url", default=None, help="a running rollout server (default: start one)")
    p.add_argument("--concurrency", type=int, default=4, help="episodes at once")
    args = p.parse_args(argv)
    with open(args.tasks, encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    start = time.perf_counter()
    rows = generate_traces(args.model, tasks, args.n, args.server_url, args.out, args.concurrency)
    elapsed = time.perf_counter() - start
    lengths = [len(r["input_ids"]) for r in rows]
    trained = [sum(r["loss_mask"]) for r in rows]
    print(f"{len(rows)} traces in {elapsed:.1f} s, all rewarded 1.0 with clean masks; tokens per "
          f"trace: mean {sum(lengths) / max(len(rows), 1):.0f}, max {max(lengths, default=0)}; "
          f"trained tokens per trace: mean {sum(trained) / max(len(rows), 1):.0f}")


if __name__ == "__main__":
    main()
