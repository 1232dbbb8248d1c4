"""`RayAgentWorkflow`: an agent's `run` in a Ray worker, failing or hanging, never leaves a
session open, and its failure names the agent's own error (a fake-engine gateway: the subject
here is the episode's lifecycle, not generation)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from relayrl.workflow import EpisodeStatus, run_episode
from tests.episodes import episode_ctx, open_sessions
from tests.workflow.agents import CrashingAgent, HangingAgent, SyncEnvAgent

ray = pytest.importorskip("ray")

DATA = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}

pytestmark = pytest.mark.slow  # Ray starts in about a minute here


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """A private Ray on one CPU, started the way `launcher: ray` starts it."""
    from relayrl.launch.ray import init_ray

    os.environ.pop("RAY_ADDRESS", None)
    assert init_ray(num_cpus=1, object_store_memory=100 * 2**20)
    yield
    ray.shutdown()


async def test_a_sync_agent_in_a_ray_worker_reads_the_session_from_its_env(
        ray_session, gw, client) -> None:
    from relayrl.launch.ray import RayAgentWorkflow

    gw.script.replies += ["4", "Yes, 4."]
    wf = RayAgentWorkflow(SyncEnvAgent(), client)
    out = await run_episode(wf, None, DATA, episode_ctx(), timeout_s=120)
    assert out.status == EpisodeStatus.FINISHED, out.error
    (row,) = out.result.values()
    assert len(row.interaction_ids) == 2 and row.turn_rewards[-1] == 1.0
    assert not open_sessions(gw)


async def test_an_agent_that_raises_in_a_ray_worker_is_aborted_with_its_error(
        ray_session, gw, client) -> None:
    from relayrl.launch.ray import RayAgentWorkflow

    wf = RayAgentWorkflow(CrashingAgent(), client)
    out = await run_episode(wf, None, DATA, episode_ctx(), timeout_s=120)
    assert out.status == EpisodeStatus.ABORTED and out.rows is None
    assert "RuntimeError" in out.error and "tool backend unreachable" in out.error
    assert not open_sessions(gw)


async def test_a_hung_agent_times_out_its_task_is_cancelled_and_the_worker_freed(
        ray_session, gw, client) -> None:
    from relayrl.launch.ray import RayAgentWorkflow

    wf = RayAgentWorkflow(HangingAgent(sync=True), client)
    out = await run_episode(wf, None, DATA, episode_ctx(), timeout_s=5.0)
    assert out.status == EpisodeStatus.ABORTED and "TimeoutError" in out.error
    assert not open_sessions(gw)
    # Ray has one CPU: the next episode runs only if the hung task was killed, not left running
    gw.script.replies += ["4", "Yes, 4."]
    again = await run_episode(RayAgentWorkflow(SyncEnvAgent(), client), None, DATA, episode_ctx(1),
                              timeout_s=120)
    assert again.status == EpisodeStatus.FINISHED, again.error
