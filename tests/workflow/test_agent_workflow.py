"""AgentWorkflow against a real gateway (FakeEngine): inline and subprocess, the real openai SDK.

Each test checks what the trainer would get (rows, rewards, ids) and that the gateway is left
with no open session, whatever the agent did.
"""

from __future__ import annotations

import threading

import pytest

from relayrl.client.session_client import SessionClient
from relayrl.errors import InvalidRequest
from relayrl.trajectory import SessionState
from relayrl.workflow import (
    AgentConfig,
    AgentWorkflow,
    EpisodeStatus,
    GroupedWorkflow,
    run_episode,
)
from tests.episodes import episode_ctx, open_sessions
from tests.gateway.conftest import ADMIN, fake_gateway
from tests.workflow.agents import (
    ChatAgent,
    CrashingAgent,
    HangingAgent,
    HttpRewardAgent,
    SyncEnvAgent,
)

DATA = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}


async def test_an_inline_agent_gets_rows_its_float_reward_and_its_ids(gw, client) -> None:
    gw.script.replies += ["The answer is 4."]
    wf = AgentWorkflow(ChatAgent(), client)
    out = await run_episode(wf, None, DATA, episode_ctx())
    assert out.status == EpisodeStatus.FINISHED, out.error
    (iid, row), = out.result.items()
    assert row.interaction_ids == [iid] and row.reward == 1.0
    assert row.task_id == "t1"
    assert out.rows.episode_ids == ("ep-grp-1-0",) and out.rows.group_ids == ("grp-1",)
    assert list(out.rows.rewards) == [1.0]
    assert sum(out.rows.rows[0].loss_mask) == sum(row.loss_mask) > 0
    assert not open_sessions(gw)


async def test_an_inline_agent_that_returns_none_keeps_the_reward_it_set_over_http(gw, client):
    wf = AgentWorkflow(HttpRewardAgent(), client)
    out = await run_episode(wf, None, DATA, episode_ctx())
    assert out.status == EpisodeStatus.FINISHED, out.error
    assert [r.reward for r in out.result.values()] == [0.5]


async def test_a_group_of_inline_agents_keeps_each_rows_episode_and_group(gw, client) -> None:
    gw.script.replies += ["4", "five", "4"]
    merged = await GroupedWorkflow(AgentWorkflow(ChatAgent(), client), 3).arun_episode(None, DATA)
    assert sorted(r.reward for r in merged.values()) == [0.0, 1.0, 1.0]
    assert len({r.metadata["episode_id"] for r in merged.values()}) == 3
    assert len({r.metadata["group_id"] for r in merged.values()}) == 1
    assert len({r.session_id for r in merged.values()}) == 3


async def test_a_sync_subprocess_agent_reads_the_env_and_rewards_each_call(gw, client) -> None:
    gw.script.replies += ["4", "Yes, 4."]
    wf = AgentWorkflow(SyncEnvAgent(), client, AgentConfig(mode="subprocess", discount=0.5,
                                                           subproc_max_workers=1))
    try:
        out = await run_episode(wf, None, DATA, episode_ctx(), timeout_s=60)
    finally:
        await wf.aclose()
    assert out.status == EpisodeStatus.FINISHED, out.error
    (row,) = out.result.values()  # concat: the second call extended the first
    assert len(row.interaction_ids) == 2
    # per-call rewards from the returned dict; discount credit: 0.25 + 0.5 * 1.0
    assert row.turn_rewards == [0.75, 1.0]
    assert not open_sessions(gw)


async def test_an_async_agent_runs_in_a_subprocess_under_asyncio_run(gw, client) -> None:
    gw.script.replies += ["4"]
    wf = AgentWorkflow(ChatAgent(), client, AgentConfig(mode="subprocess",
                                                        subproc_max_workers=1))
    try:
        out = await run_episode(wf, None, DATA, episode_ctx(), timeout_s=60)
    finally:
        await wf.aclose()
    assert out.status == EpisodeStatus.FINISHED, out.error
    assert [r.reward for r in out.result.values()] == [1.0]


@pytest.mark.parametrize("mode", ["inline", "subprocess"])
async def test_an_agent_that_raises_is_aborted_and_its_session_released(gw, client, mode):
    wf = AgentWorkflow(CrashingAgent(), client, AgentConfig(mode=mode, subproc_max_workers=1))
    try:
        out = await run_episode(wf, None, DATA, episode_ctx(), timeout_s=60)
    finally:
        await wf.aclose()
    assert out.status == EpisodeStatus.ABORTED
    assert "tool backend unreachable" in out.error and out.rows is None
    assert not open_sessions(gw)


@pytest.mark.parametrize("mode", ["inline", "subprocess"])
async def test_an_agent_that_hangs_times_out_and_its_session_is_released(gw, client, mode):
    wf = AgentWorkflow(HangingAgent(sync=mode == "subprocess"), client,
                       AgentConfig(mode=mode, subproc_max_workers=1))
    try:
        # subprocess: long enough for the worker to start and make its call
        out = await run_episode(wf, None, DATA, episode_ctx(),
                                timeout_s=1.0 if mode == "inline" else 3.0)
        if mode == "subprocess":
            assert wf._pool is not None and wf._pool.killed == 1  # the hung worker is gone
    finally:
        await wf.aclose()
    assert out.status == EpisodeStatus.ABORTED and "TimeoutError" in out.error
    assert not open_sessions(gw)


async def test_a_return_value_of_the_wrong_type_aborts_with_what_was_expected(gw, client):
    class WordAgent(ChatAgent):
        async def run(self, data, **extra):
            await super().run(data, **extra)
            return "correct"

    out = await run_episode(AgentWorkflow(WordAgent(), client), None, DATA, episode_ctx())
    assert out.status == EpisodeStatus.ABORTED
    assert "is a str" in out.error and "dict interaction id" in out.error
    assert not open_sessions(gw)


def test_an_agent_that_cannot_be_pickled_is_refused_before_anything_starts() -> None:
    class LockedAgent:
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def run(self, data, **extra):
            return 1.0

    client = SessionClient("http://127.0.0.1:9", ADMIN)  # never contacted
    with pytest.raises(InvalidRequest, match=r"LockedAgent cannot be pickled.*mode='inline'"):
        AgentWorkflow(LockedAgent(), client, AgentConfig(mode="subprocess"))


async def test_an_agent_waits_for_capacity_then_aborts_when_none_comes(model_dir) -> None:
    tight = fake_gateway(model_dir, batch_size=1, max_staleness=0)  # one session at version 0
    try:
        tight.start_session(task_id="holder")
        async with SessionClient(tight.url, ADMIN) as client:
            wf = AgentWorkflow(ChatAgent(), client,
                               AgentConfig(capacity_wait_s=0.3, capacity_poll_s=0.05))
            out = await run_episode(wf, None, DATA, episode_ctx())
        assert out.status == EpisodeStatus.ABORTED
        assert "CapacityExhausted" in out.error and "0.3 s" in out.error
        assert [s.task_id for s in tight.deps.store] == ["holder"]  # it opened nothing
    finally:
        tight.thread.stop()


@pytest.mark.parametrize("mode", ["inline", "subprocess"])
async def test_a_crashing_agent_gives_its_capacity_back(model_dir, mode) -> None:
    # batch 2, staleness 0 at version 0: two sessions may run; a failed one must not use one up
    tight = fake_gateway(model_dir, batch_size=2, max_staleness=0)
    try:
        async with SessionClient(tight.url, ADMIN) as client:
            before = await client.grant_capacity()
            wf = AgentWorkflow(CrashingAgent(), client,
                               AgentConfig(mode=mode, subproc_max_workers=1))
            try:
                out = await run_episode(wf, None, DATA, episode_ctx())
            finally:
                await wf.aclose()
            assert out.status == EpisodeStatus.ABORTED
            assert before == 2 and await client.grant_capacity() == before
        states = [s.state for s in tight.deps.store]
        assert states == [SessionState.ABORTED]  # aborted, not journaled as exported
    finally:
        tight.thread.stop()
