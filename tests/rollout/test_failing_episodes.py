"""A workflow whose episodes keep raising stops the rollouts with a clear error; it never spins."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from relayrl.errors import ConfigError, EpisodeFailed, RolloutFailed
from relayrl.rollout import RolloutConfig, RolloutController
from relayrl.workflow import RolloutWorkflow
from tests.workflow.helpers import make_td


class AlwaysRaises(RolloutWorkflow):
    """Every episode fails, as a workflow handed no usable engine would."""

    def __init__(self) -> None:
        self.episodes = 0

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        self.episodes += 1
        return engine.agenerate(data)  # engine is None: AttributeError, every time


class MostlyRaises(RolloutWorkflow):
    """Three of every four episodes fail; the fourth finishes."""

    def __init__(self) -> None:
        self.episodes = 0

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        self.episodes += 1
        if self.episodes % 4:
            raise ValueError("flaky tool")
        return make_td(1, 5, reward=float(self.episodes % 3))


def _config(**kw: Any) -> RolloutConfig:
    base = dict(group_size=2, batch_size=2, max_concurrent_rollouts=8, max_staleness=1,
                episode_timeout_s=5.0, progress=False, shuffle=False)
    return RolloutConfig(**{**base, **kw})


async def test_a_workflow_whose_every_episode_raises_stops_with_the_error_and_count() -> None:
    wf = AlwaysRaises()
    data = [{"q": i} for i in range(3)]  # epochs=None: the data cycles forever
    async with RolloutController(wf, data, _config(max_consecutive_aborts=10)) as rc:
        with pytest.raises(RolloutFailed) as info:
            async with asyncio.timeout(20):  # before the fix: aborted and relaunched forever
                await rc.next_batch()
        stats = rc.stats()
        ran = wf.episodes
        await asyncio.sleep(0.5)
        assert wf.episodes == ran  # nothing more is admitted once it failed
    msg = str(info.value)
    assert "10 episodes in a row aborted" in msg
    assert "AttributeError" in msg and "agenerate" in msg  # the exception: type and message
    assert f"{__file__}:" in msg and "in arun_episode" in msg  # where it was raised
    assert "rollout.max_consecutive_aborts: 10" in msg
    assert isinstance(info.value, EpisodeFailed)
    assert stats.aborted >= 10 and stats.accepted == 0
    # the episodes in flight when it tripped may still end: bounded by the concurrency
    assert ran <= 10 + _config().max_concurrent_rollouts


async def test_successes_between_failures_keep_the_run_going() -> None:
    wf = MostlyRaises()
    data = [{"q": i} for i in range(4)]
    async with RolloutController(wf, data, _config(max_consecutive_aborts=4, batch_size=1,
                                                   max_concurrent_rollouts=2, max_staleness=8)) as rc:
        async with asyncio.timeout(20):
            batches = [await rc.next_batch() for _ in range(3)]
    assert all(b.num_rows >= 1 for b in batches)
    assert rc.stats().aborted >= 3


async def test_the_threshold_can_be_turned_off_and_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_consecutive_aborts"):
        _config(max_consecutive_aborts=0)
    wf = AlwaysRaises()
    async with RolloutController(wf, [{"q": 0}], _config(max_consecutive_aborts=None,
                                                          epochs=3)) as rc:
        with pytest.raises(StopAsyncIteration):  # with it off, the data's end still ends it
            async with asyncio.timeout(20):
                await rc.next_batch()
    assert wf.episodes == 6
