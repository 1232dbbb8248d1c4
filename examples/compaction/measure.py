"""What training the summary changes: a small measured run of the compacting agent (compacting_agent.py).

1. Episodes of `compacting_agent.py` against an in-process gateway serving the default model (LocalEngine,
   the real tokenizer and weights), grouped by task, each finalized with its reward.
2. The rows relayrl exports: the first segment ends with the summary call (trained, loss mask 1,
   the episode's reward); the compaction segment holds the answer, the summary in its prompt.
3. GRPO updates of the policy on those rows, in two arms from the same start: `trained` (the rows
   as exported) and `dropped` (the summary call's tokens masked out, as trainers that drop the
   summary from training do). Reported: per arm, the mean change of the summary tokens' logprob
   in episodes that succeeded and in episodes that failed.

    python examples/compaction/measure.py [--tasks 4] [--group 4] [--steps 2] [--lr 1e-5]
                                          [--temperature 1.0] [--rows-out rows.jsonl]

Prints one JSON object; numbers are as measured on this machine (see docs/compaction.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compacting_agent as agent  # noqa: E402
import httpx  # noqa: E402
import torch  # noqa: E402
from compacting_agent import Episode, Task, run_episode  # noqa: E402
from openai import OpenAI  # noqa: E402

from relayrl.gateway.config import GatewayConfig  # noqa: E402
from relayrl.gateway.server import GatewayThread, build_deps  # noqa: E402
from relayrl.models import DEFAULT_MODEL, model_path  # noqa: E402
from relayrl.train.actor import Actor  # noqa: E402
from relayrl.train.advantages import compute_advantages  # noqa: E402
from relayrl.train.config import TrainConfig  # noqa: E402
from relayrl.train.packing import TrainBatch  # noqa: E402
from relayrl.trajectory import TrajectoryRow, export_session  # noqa: E402
from relayrl.trajectory.interchange import write_jsonl  # noqa: E402

ADMIN = "compaction-measure-admin"


def collect(url: str, tasks: list[Task], group: int) -> list[tuple[str, Task, Episode]]:
    """`group` episodes per task, each in its own session, finalized with its reward."""

    def one(i: int, task: Task) -> tuple[str, Task, Episode]:
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"},
                          timeout=600) as admin:
            s = admin.post("/rl/start_session", json={"task_id": f"task-{i}"}).json()
        client = OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0,
                        timeout=600)
        ep = run_episode(client, task)
        httpx.post(url + "/rl/v1/finalize", json={"final_reward": ep.reward}, timeout=60,
                   headers={"authorization": f"Bearer {s['api_key']}"}).raise_for_status()
        return s["session_id"], task, ep

    jobs = [(i, t) for i, t in enumerate(tasks) for _ in range(group)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=group) as pool:
        return list(pool.map(lambda job: one(*job), jobs))


def summary_spans(rows: list[TrajectoryRow], summary_ids: set[str]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every summary call's sampled tokens."""
    return [(i, start, end) for i, r in enumerate(rows)
            for cid, (start, end) in zip(r.interaction_ids, r.turn_spans, strict=True)
            if cid in summary_ids]


def without_summaries(rows: list[TrajectoryRow],
                      spans: list[tuple[int, int, int]]) -> list[TrajectoryRow]:
    """The rows with the summary calls' tokens out of the loss (what dropping the summary does)."""
    out = list(rows)
    for i, start, end in spans:
        mask = list(out[i].loss_mask)
        mask[start:end] = [0] * (end - start)
        out[i] = replace(out[i], loss_mask=mask)
    return out


def summary_logprob(actor: Actor, probe: TrainBatch, spans: list[tuple[int, int, int]]
                    ) -> list[float]:
    """Mean logprob per token of each summary under the actor's current weights."""
    lp_B_T = actor.compute_logprobs(probe)
    # compute_logprobs gives the logprob of token t at position t (0 off the mask)
    return [float(lp_B_T[i, start:end].mean()) for i, start, end in spans]


def train_arm(model_dir: str, cfg: TrainConfig, rows: list[TrajectoryRow], probe: TrainBatch,
              spans: list[tuple[int, int, int]], steps: int) -> dict[str, Any]:
    """GRPO steps on `rows`; the summaries' logprobs before and after."""
    actor = Actor(model_dir, cfg)
    before = summary_logprob(actor, probe, spans)
    batch = TrainBatch.from_rows(rows)
    t0 = time.perf_counter()
    metrics = []
    for _ in range(steps):
        adv = compute_advantages(batch, cfg)
        metrics.append(actor.update(adv.batch, adv.adv_B_T))
    after = summary_logprob(actor, probe, spans)
    return {"before": before, "after": after, "update_s": round(time.perf_counter() - t0, 1),
            "trained_tokens": [m.get("n_tokens") for m in metrics]}


def main() -> None:
    """Collect, train both arms, print the measurement."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=agent.TEMPERATURE)
    p.add_argument("--rows-out", default=None, help="also write the exported rows (JSONL) here")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    agent.TEMPERATURE = args.temperature
    model_dir = model_path(DEFAULT_MODEL)
    rng = random.Random(args.seed)
    tasks = [Task.sample(rng) for _ in range(args.tasks)]
    load = os.getloadavg()
    started = time.perf_counter()
    cfg = GatewayConfig(model=model_dir, engine="local", admin_key=ADMIN)
    with GatewayThread(build_deps(cfg)) as gw:
        episodes = collect(gw.url, tasks, args.group)
        sessions = [gw.deps.store.get(sid) for sid, _, _ in episodes]
        rows = [r for s in sessions for r in export_session(s)]
    collect_s = time.perf_counter() - started
    if args.rows_out:
        write_jsonl(rows, args.rows_out)
    print(f"collected {len(episodes)} episodes in {collect_s:.0f} s "
          f"(reward mean {sum(ep.reward for _, _, ep in episodes) / len(episodes):.3f})",
          file=sys.stderr, flush=True)
    summary_ids = {s.interactions[-2].id for s in sessions}  # the call before the answer
    assert all(s.interactions[-1].parent_id in summary_ids for s in sessions)
    spans = summary_spans(rows, summary_ids)
    rewards = {s.id: ep.reward for s, (_, _, ep) in zip(sessions, episodes, strict=True)}
    kept = [t.code.lower() in ep.summary.lower() for _, t, ep in episodes]
    probe = TrainBatch.from_rows(rows)
    tcfg = TrainConfig(lr=args.lr, micro_batch_tokens=2048)
    arms = {"trained": train_arm(model_dir, tcfg, rows, probe, spans, args.steps)}
    print(f"arm trained: {arms['trained']['update_s']} s", file=sys.stderr, flush=True)
    arms["dropped"] = train_arm(model_dir, tcfg, without_summaries(rows, spans), probe, spans,
                                args.steps)
    outcome = [rewards[rows[i].session_id] for i, _, _ in spans]

    def mean_delta(arm: dict[str, Any], reward: float) -> float | None:
        d = [a - b for a, b, r in zip(arm["after"], arm["before"], outcome, strict=True)
             if r == reward]
        return round(sum(d) / len(d), 4) if d else None

    print(json.dumps({
        "episodes": len(episodes), "tasks": args.tasks, "group": args.group,
        "reward_mean": round(sum(rewards.values()) / len(rewards), 3),
        "summary_kept_code": round(sum(kept) / len(kept), 3),
        "reward_when_code_kept": round(sum(ep.reward for (_, _, ep), k in
                                           zip(episodes, kept, strict=True) if k)
                                       / max(1, sum(kept)), 3),
        "reward_when_code_lost": round(sum(ep.reward for (_, _, ep), k in
                                           zip(episodes, kept, strict=True) if not k)
                                       / max(1, len(kept) - sum(kept)), 3),
        "rows": len(rows), "summary_tokens_trained": sum(e - s for _, s, e in spans),
        "steps": args.steps, "lr": args.lr, "temperature": args.temperature,
        "delta_summary_logprob": {
            arm: {"succeeded": mean_delta(v, 1.0), "failed": mean_delta(v, 0.0)}
            for arm, v in arms.items()},
        "update_s": {arm: v["update_s"] for arm, v in arms.items()},
        "collect_s": round(collect_s, 1),
        "load_avg_at_start": [round(x, 2) for x in load],
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        "examples": [{"code": t.code, "summary": ep.summary, "answer": ep.answer,
                      "reward": ep.reward} for _, t, ep in episodes[:3]],
    }, indent=1))


if __name__ == "__main__":
    main()
