"""RolloutController with toy workflows: batches of whole groups, outcomes, timeouts, pause, dumps."""

from __future__ import annotations

import asyncio
import json

import pytest

from relayrl.errors import ConfigError, InvalidRequest
from relayrl.rollout import RolloutConfig, RolloutController
from relayrl.workflow import GroupedWorkflow
from relayrl.workflow import workflow_context as wc
from tests.workflow.helpers import LengthWorkflow, ScriptedWorkflow, make_td


def _config(**kw) -> RolloutConfig:
    base = dict(group_size=3, batch_size=2, max_concurrent_rollouts=12, max_staleness=1,
                episode_timeout_s=5.0, progress=False, shuffle=False)
    return RolloutConfig(**{**base, **kw})


async def test_a_batch_holds_whole_groups_with_ids_per_row() -> None:
    data = [{"seqlen": 3 + i, "reward": float(i)} for i in range(4)]
    async with RolloutController(LengthWorkflow(), data, _config()) as rc:
        batch = await rc.next_batch()
    assert batch.group_sizes == (3, 3) and batch.num_rows == 6
    assert batch.rows.num_rows == 6 and len(batch.rows.rows) == 6
    assert len(set(batch.episode_ids)) == 6
    for start in (0, 3):  # a group's rows are contiguous and share group and task
        assert len(set(batch.group_ids[start:start + 3])) == 1
        assert len(set(batch.task_ids[start:start + 3])) == 1
    assert batch.group_ids[0] != batch.group_ids[3]
    rewards = list(batch.rows.rewards)
    assert rewards[:3] == [rewards[0]] * 3  # same data item, same reward
    assert batch.stats.accepted >= 6 and batch.stats.rows_out == 6


async def test_aborted_and_rejected_episodes_are_counted_and_never_trained_on() -> None:
    data = [{"plan": ["ok", "raise", "none"]}]
    async with RolloutController(ScriptedWorkflow(), data, _config(batch_size=2)) as rc:
        batch = await rc.next_batch()
        stats = rc.stats()
    assert batch.group_sizes == (1, 1)  # only the "ok" member of each group
    assert list(batch.rows.rewards) == [1.0, 1.0]
    assert stats.aborted >= 2 and stats.rejected >= 2
    assert any("ValueError: agent crashed on purpose" in e for e in stats.recent_errors)


async def test_an_episode_past_its_timeout_is_aborted_and_the_group_goes_on() -> None:
    data = [{"plan": ["ok", "hang"]}]
    cfg = _config(group_size=2, batch_size=1, episode_timeout_s=0.2)
    async with RolloutController(ScriptedWorkflow(), data, cfg) as rc:
        batch = await asyncio.wait_for(rc.next_batch(), 5)
        stats = rc.stats()
    assert batch.group_sizes == (1,)
    assert stats.aborted >= 1
    assert any("TimeoutError" in e for e in stats.recent_errors)


async def test_a_group_with_nothing_to_train_gives_its_slot_back() -> None:
    # max_staleness 0, batch 1: one group may be accepted at version 0; dropped groups must not
    # use that slot up, or the trainer would wait forever for a batch
    data = [{"plan": ["none"]}, {"plan": ["raise"]}, {"plan": ["ok"]}]
    cfg = _config(group_size=1, batch_size=1, max_staleness=0, max_concurrent_rollouts=1)
    async with RolloutController(ScriptedWorkflow(), data, cfg) as rc:
        batch = await asyncio.wait_for(rc.next_batch(), 5)
        stats = rc.stats()
    assert batch.num_rows == 1
    assert stats.groups_dropped >= 2 and stats.groups_accepted == 1


async def test_admission_stops_at_the_staleness_limit_until_the_version_moves() -> None:
    cfg = _config(group_size=1, batch_size=2, max_staleness=0, max_concurrent_rollouts=8)
    rc = RolloutController(LengthWorkflow(), [{"seqlen": 3}], cfg)
    batch = await asyncio.wait_for(rc.next_batch(), 5)
    assert batch.num_rows == 2
    await asyncio.sleep(0.05)
    assert rc.stats().groups_accepted == 2  # limit (0 + 0 + 1) * 2 reached: nothing more runs
    assert rc.stats().running == 0
    rc.set_version(1)
    batch = await asyncio.wait_for(rc.next_batch(), 5)
    assert batch.version == 1 and rc.stats().groups_accepted == 4
    await rc.aclose()


async def test_limit_batches_admits_no_group_for_a_batch_nobody_takes() -> None:
    # staleness alone would let (0 + 5 + 1) * 2 = 12 groups run; the trainer wants 2 batches
    cfg = _config(group_size=1, batch_size=2, max_staleness=5, max_concurrent_rollouts=8)
    rc = RolloutController(LengthWorkflow(), [{"seqlen": 3}], cfg)
    rc.limit_batches(2)
    await asyncio.wait_for(rc.next_batch(), 5)
    rc.limit_batches(1)  # what the trainer says before taking its last batch
    await asyncio.wait_for(rc.next_batch(), 5)
    await asyncio.sleep(0.05)
    assert rc.stats().groups_accepted == 4 and rc.stats().running == 0
    rc.limit_batches(1)  # a batch without signal took no step: one more batch
    await asyncio.wait_for(rc.next_batch(), 5)
    await asyncio.sleep(0.05)
    assert rc.stats().groups_accepted == 6
    rc.limit_batches(None)
    await asyncio.wait_for(rc.next_batch(), 5)
    assert rc.stats().groups_accepted > 8  # staleness limits it again: (0 + 5 + 1) * 2
    await rc.aclose()
    with pytest.raises(InvalidRequest, match="remaining batches"):
        rc.limit_batches(-1)


async def test_limit_batches_still_runs_dynamic_sampling_replacements() -> None:
    data = [{"reward": 1.0}, {}, {"reward": 0.0}, {}]  # uniform, spread, uniform, spread
    cfg = _config(group_size=2, batch_size=2, max_staleness=3, dynamic_sampling=True,
                  max_concurrent_rollouts=2)
    rc = RolloutController(LengthWorkflow(), data, cfg)
    rc.limit_batches(1)
    batch = await asyncio.wait_for(rc.next_batch(), 5)
    await asyncio.sleep(0.05)
    assert batch.group_sizes == (2, 2) and rc.stats().groups_set_aside == 2
    assert rc.stats().groups_accepted == 2 and rc.stats().running == 0
    await rc.aclose()


async def test_a_paused_controller_admits_nothing_until_resumed() -> None:
    rc = RolloutController(LengthWorkflow(), [{"seqlen": 3}], _config())
    rc.pause()
    rc.start()
    await asyncio.sleep(0.1)
    assert rc.stats().running == 0 and rc.stats().accepted == 0 and rc.stats().paused
    rc.resume()
    batch = await asyncio.wait_for(rc.next_batch(), 5)
    assert batch.num_rows == 6
    await rc.aclose()


async def test_closing_cancels_running_episodes_and_nothing_keeps_running() -> None:
    rc = RolloutController(ScriptedWorkflow(), [{"plan": ["hang"]}], _config())
    rc.start()
    await asyncio.sleep(0.05)
    assert rc.stats().running == 12  # (0 + 1 + 1) * 2 = 4 groups of three may run
    await rc.aclose()
    assert rc.stats().running == 0 and rc.gate.running == 0


async def test_a_finite_dataset_ends_with_a_partial_batch_then_stops() -> None:
    cfg = _config(group_size=2, batch_size=2, epochs=1, max_staleness=4)
    async with RolloutController(LengthWorkflow(), [{"seqlen": 3}] * 3, cfg) as rc:
        batches = [b async for b in rc]
    assert [b.group_sizes for b in batches] == [(2, 2), (2,)]


async def test_accepted_groups_are_dumped_under_their_version_and_task(tmp_path) -> None:
    cfg = _config(group_size=2, batch_size=1, dump_root=str(tmp_path), experiment="e",
                  trial="t", epochs=1)
    async with RolloutController(LengthWorkflow(), [{"seqlen": 3}], cfg) as rc:
        batch = await rc.next_batch()
    path = tmp_path / "e" / "t" / "rollout" / "0" / f"{batch.task_ids[0]}.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["sample_idx"] for x in lines] == [0, 1]
    assert {x["episode_id"] for x in lines} == set(batch.episode_ids)


async def test_eval_episodes_see_is_eval_and_dump_under_eval_rollout(tmp_path) -> None:
    wf = LengthWorkflow()
    cfg = _config(group_size=1, batch_size=1, dump_root=str(tmp_path), is_eval=True, epochs=1)
    async with RolloutController(wf, [{"seqlen": 3}], cfg) as rc:
        await rc.next_batch()
    assert wf.seen and all(c.is_eval and c.stat_scope == "eval-rollout" for c in wf.seen)
    assert list((tmp_path / "default" / "trial0" / "eval-rollout").rglob("*.jsonl"))


def test_a_group_larger_than_the_concurrency_limit_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_concurrent_rollouts"):
        RolloutConfig(group_size=8, max_concurrent_rollouts=4)


def test_a_grouped_workflow_must_match_the_configured_group_size() -> None:
    with pytest.raises(ConfigError, match="grouped by 4"):
        RolloutController(GroupedWorkflow(LengthWorkflow(), 4), [{}], _config(group_size=3))


class VersionedWorkflow(LengthWorkflow):
    """Tokens carry the version the episode was admitted at, as an engine would stamp them."""

    async def arun_episode(self, engine, data):

        return make_td(1, 4, version=wc.get().version)


async def test_staleness_is_the_hand_out_version_minus_the_sampling_version() -> None:
    cfg = _config(group_size=1, batch_size=1, max_staleness=1, max_concurrent_rollouts=1)
    rc = RolloutController(VersionedWorkflow(), [{}], cfg)
    first = await asyncio.wait_for(rc.next_batch(), 5)  # sampled and handed out at version 0
    assert first.staleness == (0,)
    await asyncio.sleep(0.05)  # the second group (allowed by max_staleness=1) finishes at v0
    rc.set_version(1)
    second = await asyncio.wait_for(rc.next_batch(), 5)
    assert second.version == 1 and second.staleness == (1,)
    assert second.stats.mean_staleness == pytest.approx(0.5)
    await rc.aclose()


async def test_dynamic_sampling_sets_uniform_groups_aside_and_samples_others() -> None:
    # items with a "reward" give every episode that reward (uniform group); the others give
    # each episode its sample index (a spread)
    data = [{"reward": 1.0}, {"reward": 0.0}, {}, {"reward": 1.0}, {}]
    cfg = _config(group_size=3, batch_size=2, dynamic_sampling=True, max_staleness=0,
                  max_concurrent_rollouts=3)
    async with RolloutController(LengthWorkflow(), data, cfg) as rc:
        batch = await asyncio.wait_for(rc.next_batch(), 5)
        stats = rc.stats()
    assert batch.group_sizes == (3, 3)
    for start in (0, 3):  # both batched groups carry a spread of rewards
        assert len(set(batch.rows.rewards[start:start + 3])) == 3
    assert stats.groups_set_aside == 3  # items 0, 1 and 3 were sampled and set aside
    assert stats.groups_accepted == 2


async def test_dynamic_sampling_batches_uniform_groups_once_its_budget_is_spent() -> None:
    data = [{"reward": 1.0}]  # every group uniform: without a budget no batch would ever come
    cfg = _config(group_size=2, batch_size=2, dynamic_sampling=True, dynamic_sampling_budget=1,
                  max_staleness=0, max_concurrent_rollouts=2)
    async with RolloutController(LengthWorkflow(), data, cfg) as rc:
        first = await asyncio.wait_for(rc.next_batch(), 5)
        set_aside_first = rc.stats().groups_set_aside
        rc.set_version(1)  # the trainer's step: the budget starts again for the next batch
        await asyncio.wait_for(rc.next_batch(), 5)
        stats = rc.stats()
    assert first.group_sizes == (2, 2) and set(first.rows.rewards) == {1.0}
    assert set_aside_first == 2  # budget 1 x batch 2
    assert stats.groups_set_aside == 4


async def test_dynamic_sampling_is_off_by_default_and_in_eval() -> None:
    data = [{"reward": 1.0}]
    for cfg in (_config(group_size=2, batch_size=1),
                _config(group_size=2, batch_size=1, dynamic_sampling=True, is_eval=True)):
        async with RolloutController(LengthWorkflow(), data, cfg) as rc:
            batch = await asyncio.wait_for(rc.next_batch(), 5)
            assert batch.group_sizes == (2,) and rc.stats().groups_set_aside == 0


def test_a_negative_dynamic_sampling_budget_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="dynamic_sampling_budget"):
        _config(dynamic_sampling_budget=-1)
