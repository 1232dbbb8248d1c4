"""AgentRunner over a loopback gateway: grouping, rewards from return values, aborts counted,
epoch loops, back-pressure on start."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import httpx
import openai
import pytest

from relayrl.client import AgentRunner
from relayrl.gateway.routes_rl_v1 import state_of
from relayrl.trajectory import SessionState
from tests.gateway.conftest import ADMIN, Gateway

BODY = {"model": "m", "max_tokens": 8}


def sessions(gw: Gateway) -> list[Any]:
    return list(gw.deps.store)


def prompt_of(gw: Gateway, session_id: str) -> str:
    rows = gw.export(session_id, style="individual")
    return gw.deps.renderer.decode(rows[0]["input_ids"])


async def ask(url: str, text: str) -> Any:
    """An unchanged agent step: a plain OpenAI client on the service URL, any key."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="anything", max_retries=0)
    try:
        return await client.chat.completions.create(
            messages=[{"role": "user", "content": text}], **BODY)
    finally:
        await client.close()


async def test_groups_items_and_takes_numbers_as_final_rewards(svc: Gateway) -> None:
    async def agent(item: dict[str, Any]) -> float:
        await ask(svc.url, f"question {item['q']}")
        return item["score"]

    data = [{"q": "a", "score": 1.0}, {"q": "b", "score": 0.0}, {"q": "c", "score": 0.5}]
    summary = await AgentRunner(svc.url, group_size=2, concurrency=4, api_key=ADMIN,
                                progress=False).run(agent, data)
    assert (summary.finished, summary.aborted) == (6, 0)
    assert summary.mean_reward == pytest.approx(0.5)
    groups: dict[str, list[Any]] = defaultdict(list)
    for s in sessions(svc):
        assert s.state == SessionState.ENDED
        groups[s.task_id].append(s)
    assert sorted(len(g) for g in groups.values()) == [2, 2, 2]
    for members in groups.values():  # one group: the tries of one item, with its reward
        prompts = {prompt_of(svc, s.id).split("question ")[1][0] for s in members}
        assert len(prompts) == 1
        [item] = [d for d in data if d["q"] in prompts]
        assert all(s.final_reward == item["score"] for s in members)


async def test_failures_are_aborted_counted_and_reported_not_retried(svc: Gateway) -> None:
    calls: list[int] = []

    async def agent(i: int) -> float:
        calls.append(i)
        await ask(svc.url, f"item {i}")
        if i == 1:
            raise ValueError("grader exploded")
        return 1.0

    summary = await AgentRunner(svc.url, api_key=ADMIN, progress=False).run(agent, [0, 1, 2])
    assert sorted(calls) == [0, 1, 2]  # nothing retried
    assert (summary.finished, summary.aborted) == (2, 1)
    assert summary.errors == ["item #1: ValueError: grader exploded"]
    states = sorted(str(s.state) for s in sessions(svc))
    assert states == ["aborted", "ended", "ended"]


async def test_dict_returns_reward_calls_and_sync_agents_work(svc: Gateway) -> None:
    def sync_agent(text: str) -> dict[str, float]:  # runs in a context-copying thread
        client = openai.OpenAI(base_url=svc.url + "/v1", api_key="anything", max_retries=0)
        r = client.chat.completions.create(messages=[{"role": "user", "content": text}], **BODY)
        return {r.id: 0.25}

    summary = await AgentRunner(svc.url, api_key=ADMIN, progress=False).run(sync_agent, ["x"])
    assert (summary.finished, summary.mean_reward) == (1, None)
    [s] = sessions(svc)
    assert [c.reward for c in s.interactions] == [0.25]


async def test_a_non_reward_return_value_aborts_the_episode(svc: Gateway) -> None:
    async def agent(_: Any) -> str:
        await ask(svc.url, "x")
        return "not a reward"

    summary = await AgentRunner(svc.url, api_key=ADMIN, progress=False).run(agent, [1])
    assert summary.aborted == 1 and "EpisodeFailed" in summary.errors[0]
    assert sessions(svc)[0].state == SessionState.ABORTED


async def test_epoch_loops_and_progress_bar(svc: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    async def agent(i: int) -> float:
        await ask(svc.url, f"e {i}")
        return float(i)

    for _ in range(2):
        summary = await AgentRunner(svc.url, api_key=ADMIN, concurrency=2).run(agent, [0, 1])
        assert summary.finished == 2 and summary.mean_reward == 0.5
    assert len(sessions(svc)) == 4
    assert "episodes" in capsys.readouterr().err  # tqdm drew its bar


async def test_runner_waits_while_the_service_answers_429(svc: Gateway) -> None:
    refusals = {"left": 2, "asked": 0}

    def admit(_deps: Any) -> float | None:  # the hook a trainer that falls behind uses
        refusals["asked"] += 1
        if refusals["left"] > 0:
            refusals["left"] -= 1
            return 0.2
        return None

    state_of(svc.thread.app).admit = admit

    async def agent(i: int) -> float:
        await ask(svc.url, f"bp {i}")
        return 1.0

    summary = await AgentRunner(svc.url, api_key=ADMIN, concurrency=2,
                                progress=False).run(agent, [0, 1])
    assert (summary.finished, summary.aborted, summary.start_waits) == (2, 0, 2)
    assert refusals["asked"] == 4
    status = httpx.get(svc.url + "/rl/v1/status").json()
    assert status["sessions"]["refused"] == 2 and status["sessions"]["finished_waiting"] == 2
    assert status["recent_reward"] == {"count": 2, "mean": 1.0}


async def test_start_that_never_gets_capacity_is_an_aborted_episode(svc: Gateway) -> None:
    state_of(svc.thread.app).admit = lambda _deps: 30.0
    ran: list[int] = []

    async def agent(i: int) -> float:
        ran.append(i)
        return 1.0

    summary = await asyncio.wait_for(
        AgentRunner(svc.url, api_key=ADMIN, progress=False, start_wait_s=1).run(agent, [0]), 10)
    assert ran == [] and summary.aborted == 1 and "CapacityExhausted" in summary.errors[0]
