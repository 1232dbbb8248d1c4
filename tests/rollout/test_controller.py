"""RolloutController with toy workflows: batches of whole groups, outcomes, timeouts, pause, dumps."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from relayrl.errors import ConfigError, InvalidRequest
from relayrl.rollout import RolloutConfig, RolloutController
from relayrl.workflow import GroupedWorkflow, RolloutWorkflow
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


async def _epoch_by_batch(data: list[dict], **kw) -> list[list[int]]:
    """The item indices (their rewards) of each batch of 3 over one epoch, one batch a version."""
    cfg = _config(group_size=1, batch_size=3, epochs=1, max_staleness=0, **kw)
    out: list[list[int]] = []
    async with RolloutController(LengthWorkflow(), data, cfg) as rc:
        async for batch in rc:
            out.append(sorted(int(r) for r in batch.rows.rewards))
            rc.set_version(len(out))
    return out


async def test_stratify_by_takes_one_item_of_each_value_in_turn() -> None:
    forms = ["a", "a", "a", "a", "b", "b", "c", "c", "c"]  # clustered, unequal strata
    data = [{"form": f, "reward": float(i)} for i, f in enumerate(forms)]
    by_form = await _epoch_by_batch(data, stratify_by="form")
    form_of = [[forms[i] for i in batch] for batch in by_form]
    # round-robin in order of first appearance; a stratum that runs out drops out of the turn
    assert [sorted(b) for b in form_of] == [["a", "b", "c"], ["a", "b", "c"], ["a", "a", "c"]]
    shuffled = [await _epoch_by_batch(data, stratify_by="form", shuffle=True, seed=s)
                for s in (1, 2, 3)]
    for batches in shuffled:  # shuffled within each stratum, still one of each value a turn
        assert sorted(i for b in batches for i in b) == list(range(9))
        assert [sorted(forms[i] for i in b) for b in batches] == [sorted(b) for b in form_of]
    assert len({str(b) for b in shuffled}) > 1  # the seed orders items within a stratum
    plain = await _epoch_by_batch(data, stratify_by=None)
    assert plain == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_stratify_by_a_field_some_item_lacks_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="item 1 has no such field"):
        RolloutController(LengthWorkflow(), [{"form": "a"}, {}], _config(stratify_by="form"))


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
        from relayrl.workflow import workflow_context as wc

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


class ByIndexWorkflow(LengthWorkflow):
    """Episode i of an item gets `data["rewards"][i]` (its episodes numbered across rounds)."""

    async def arun_episode(self, engine, data):
        ctx = wc.get()
        self.seen.append(ctx)
        return make_td(1, 4, reward=float(data["rewards"][ctx.sample_index]))


async def test_a_uniform_group_grows_until_its_rewards_differ_and_trains_whole() -> None:
    # item 0 fails its first 4 episodes and solves the 6th: two more rounds of 2, one group of 6
    data = [{"rewards": [0, 0, 0, 0, 0, 1, 0, 0]}, {"rewards": [0, 1]}]
    wf = ByIndexWorkflow()
    cfg = _config(group_size=2, batch_size=2, grow_uniform_groups=3, max_staleness=0,
                  max_concurrent_rollouts=4)
    async with RolloutController(wf, data, cfg) as rc:
        batch = await asyncio.wait_for(rc.next_batch(), 5)
        stats = rc.stats()
    assert sorted(batch.group_sizes) == [2, 6] and len(set(batch.task_ids)) == 2
    grown = next(i for i, n in enumerate(batch.group_sizes) if n == 6)
    start = sum(batch.group_sizes[:grown])
    assert sorted(batch.rows.rewards[start:start + 6]) == [0, 0, 0, 0, 0, 1]
    assert len(set(batch.group_ids[start:start + 6])) == 1  # one group for the advantages
    indices = sorted(c.sample_index for c in wf.seen if c.group_id == batch.group_ids[start])
    assert indices == [0, 1, 2, 3, 4, 5]  # numbered across rounds, none repeated
    assert stats.groups_grown == 2 and stats.grown_groups_with_signal == 1
    assert stats.running == 0 and stats.groups_set_aside == 0


async def test_a_group_that_stays_uniform_stops_growing_and_goes_to_dynamic_sampling() -> None:
    data = [{"rewards": [1] * 8}, {"rewards": [0, 1]}, {"rewards": [1, 0]}]
    cfg = _config(group_size=2, batch_size=2, grow_uniform_groups=2, dynamic_sampling=True,
                  max_staleness=0, max_concurrent_rollouts=2)
    async with RolloutController(ByIndexWorkflow(), data, cfg) as rc:
        batch = await asyncio.wait_for(rc.next_batch(), 5)
        stats = rc.stats()
    assert batch.group_sizes == (2, 2)  # the uniform item was set aside after 2 rounds
    assert stats.groups_grown == 2 and stats.grown_groups_with_signal == 0
    assert stats.groups_set_aside == 1 and stats.running == 0


async def test_groups_never_grow_in_eval_or_by_default() -> None:
    data = [{"rewards": [1, 1, 0, 0]}]
    for cfg in (_config(group_size=2, batch_size=1),
                _config(group_size=2, batch_size=1, grow_uniform_groups=1, is_eval=True)):
        async with RolloutController(ByIndexWorkflow(), data, cfg) as rc:
            batch = await asyncio.wait_for(rc.next_batch(), 5)
            assert batch.group_sizes == (2,) and rc.stats().groups_grown == 0


async def test_a_growing_group_takes_its_own_freed_slots_before_a_new_group() -> None:
    # Groups of 2 under a cap of 4, each round of a group behind its own gate ("a0", "a1"):
    # a's first round ends uniform and its slots go to its second round, not to item c, which
    # starts only when b ends.
    wf = RoundGatedWorkflow()
    cfg = _config(group_size=2, batch_size=2, grow_uniform_groups=1, max_staleness=1,
                  max_concurrent_rollouts=4)
    data = [{"key": "a", "reward": 1.0}, {"key": "b"}, {"key": "c"}, {"key": "d"}]
    async with RolloutController(wf, data, cfg) as rc:
        rc.start()
        await _until(lambda: wf.started == ["a0", "b0"])
        wf.release("a0")
        await _until(lambda: wf.started == ["a0", "b0", "a1"])
        assert rc.stats().groups_grown == 1 and rc.stats().running == 4
        wf.release("b0")  # b ends with signal: its slots go to the next item
        await _until(lambda: wf.started == ["a0", "b0", "a1", "c0"])
        assert rc.stats().running == 4
        wf.release("a1", "c0", "d0")
        batch = await asyncio.wait_for(rc.next_batch(), 5)
    assert sorted(batch.group_sizes) == [2, 4]


def test_a_negative_growth_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="grow_uniform_groups"):
        _config(grow_uniform_groups=-1)


async def test_a_uniform_group_far_from_its_kinds_record_trains_against_that_record() -> None:
    # one group at a time, in data order; "reward" makes a group uniform, no reward a spread
    data = [{"kind": "x", "reward": 1.0},  # no record yet: set aside; record x = [1, 1]
            {"kind": "x"},                 # rewards 0, 1: batched; record x = [1, 1, 0, 1]
            {"kind": "x", "reward": 0.0},  # |0 - 0.75| >= 0.3: trained against 0.75
            {"kind": "y", "reward": 0.0},  # no record of y: set aside
            {"kind": "x", "reward": 0.0},  # record x = [0, 1, 0, 0]: |0 - 0.25| < 0.3, aside
            {"kind": "y"}]
    cfg = _config(group_size=2, batch_size=1, dynamic_sampling=True, max_staleness=0,
                  max_concurrent_rollouts=2, baseline_by="kind", baseline_window=4,
                  baseline_min_gap=0.3, epochs=1)
    async with RolloutController(LengthWorkflow(), data, cfg) as rc:
        batches = []
        for version in range(1, 4):
            batches.append(await asyncio.wait_for(rc.next_batch(), 5))
            rc.set_version(version)
        stats = rc.stats()
    assert [b.rows.rewards for b in batches] == [(0.0, 1.0), (0.0, 0.0), (0.0, 1.0)]
    assert batches[0].baselines == {} and batches[2].baselines == {}
    assert batches[1].baselines == {batches[1].group_ids[0]: pytest.approx(0.75)}
    assert stats.groups_baselined == 1 and stats.groups_set_aside == 3


async def test_running_baselines_are_off_by_default_and_in_eval() -> None:
    # one group at a time: x's record is [0, 1, 0, 1] when the uniform group ends
    data = [{"kind": "x"}, {"kind": "x"}, {"kind": "x", "reward": 0.0}]
    base = dict(group_size=2, batch_size=3, max_concurrent_rollouts=2, max_staleness=0,
                epochs=1, dynamic_sampling=True)
    on = dict(baseline_by="kind", baseline_window=4)
    for kw, kept in (({}, 0), ({**on, "is_eval": True}, 0), (on, 1)):
        async with RolloutController(LengthWorkflow(), data, _config(**{**base, **kw})) as rc:
            batch = await asyncio.wait_for(rc.next_batch(), 5)
            stats = rc.stats()
        assert len(batch.baselines) == stats.groups_baselined == kept, kw
        assert len(batch.group_sizes) == (2 if kw == {} else 3), kw  # default: set aside


def test_baseline_settings_out_of_range_or_a_missing_field_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="baseline_window"):
        _config(baseline_window=1)
    with pytest.raises(ConfigError, match="baseline_min_gap"):
        _config(baseline_min_gap=0)
    with pytest.raises(ConfigError, match="item 1 has no such field"):
        RolloutController(LengthWorkflow(), [{"kind": "x"}, {}], _config(baseline_by="kind"))


class GatedWorkflow(RolloutWorkflow):
    """Each item's episodes wait for that item's gate; reward from the data, else a spread."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.started: list[str] = []
        self.cancelled: list[str] = []

    def release(self, *keys: str) -> None:
        for key in keys:
            self.gates.setdefault(key, asyncio.Event()).set()

    async def arun_episode(self, engine, data):
        ctx = wc.get()
        key = data["key"]
        if ctx.sample_index == 0:
            self.started.append(key)
        try:
            await self.gates.setdefault(key, asyncio.Event()).wait()
        except asyncio.CancelledError:
            if ctx.sample_index == 0:
                self.cancelled.append(key)
            raise
        return make_td(1, 4, reward=float(data.get("reward", ctx.sample_index)))


class RoundGatedWorkflow(GatedWorkflow):
    """GatedWorkflow with a gate per round of members: key + round ("a0", "a1", ...); `started`
    lists each round's gate as its first member starts. Groups of 2."""

    async def arun_episode(self, engine, data):
        ctx = wc.get()
        key = f"{data['key']}{ctx.sample_index // 2}"
        if ctx.sample_index % 2 == 0:
            self.started.append(key)
        await self.gates.setdefault(key, asyncio.Event()).wait()
        return make_td(1, 4, reward=float(data.get("reward", ctx.sample_index)))


async def _until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def _oversampled(data: list[dict]) -> tuple[GatedWorkflow, RolloutController]:
    """Gated episodes, groups of 2, batches of 2 at staleness 0 (the rule alone runs 2 groups
    at once), 2 groups oversampled."""
    wf = GatedWorkflow()
    cfg = _config(group_size=2, batch_size=2, max_staleness=0, max_concurrent_rollouts=20,
                  dynamic_sampling=True, oversample_groups=2)
    return wf, RolloutController(wf, data, cfg)


async def test_oversampling_runs_replacements_early_and_batches_in_admission_order() -> None:
    # a uniform, b c d spread
    wf, rc = _oversampled([{"key": "a", "reward": 1.0}, {"key": "b"}, {"key": "c"},
                           {"key": "d"}, {"key": "e"}, {"key": "f"}])
    async with rc:
        rc.start()
        await _until(lambda: len(wf.started) == 4)
        await asyncio.sleep(0.05)
        assert wf.started == ["a", "b", "c", "d"]  # 2 admitted by the rule, 2 oversampled
        wf.release("d", "c")  # the later groups end first: they wait for a and b
        await asyncio.sleep(0.05)
        assert rc.stats().groups_queued == 0
        wf.release("b", "a")
        batch = await asyncio.wait_for(rc.next_batch(), 5)
        stats = rc.stats()
        # b and c: the first groups with signal in data order, not the first to end (d, c)
        assert batch.task_ids == ("1", "1", "2", "2") and batch.staleness == (0, 0, 0, 0)
        assert stats.groups_set_aside == 1 and stats.groups_discarded == 1  # a; d (too new)
        assert stats.groups_accepted == 2 and stats.running == 0
        assert wf.started == ["a", "b", "c", "d"]  # nothing new fits version 0's bound


async def test_oversampled_groups_that_can_only_be_discarded_are_cancelled() -> None:
    wf, rc = _oversampled([{"key": k} for k in "abcde"])
    async with rc:
        rc.start()
        await _until(lambda: len(wf.started) == 4)
        wf.release("a", "b")  # both carry signal: the batch is full, c and d can only be discarded
        batch = await asyncio.wait_for(rc.next_batch(), 5)
        await _until(lambda: rc.stats().running == 0)
        assert sorted(wf.cancelled) == ["c", "d"]
        assert batch.task_ids == ("0", "0", "1", "1")
        assert rc.stats().groups_discarded == 2 and rc.stats().groups_dropped == 0
        rc.set_version(1)  # the next batch's groups start: the bound has room again
        await _until(lambda: "e" in wf.started)


async def test_oversampling_keeps_every_row_within_max_staleness() -> None:
    # random episode lengths and a mix of uniform and spread groups, trained one step a batch
    rng = random.Random(7)
    data = [{"seqlen": 3, **({"reward": 1.0} if rng.random() < 0.5 else {})} for _ in range(64)]
    for staleness in (0, 1):
        cfg = _config(group_size=2, batch_size=2, max_staleness=staleness,
                      max_concurrent_rollouts=16, dynamic_sampling=True, oversample_groups=3,
                      dynamic_sampling_budget=100)
        async with RolloutController(JitterWorkflow(rng), data, cfg) as rc:
            for step in range(6):
                batch = await asyncio.wait_for(rc.next_batch(), 5)
                assert max(batch.staleness) <= staleness
                for start in range(0, batch.num_rows, 2):  # only groups with signal
                    assert len(set(batch.rows.rewards[start:start + 2])) == 2
                await asyncio.sleep(rng.random() * 0.02)  # the update
                rc.set_version(step + 1)
            assert rc.stats().groups_discarded + rc.stats().groups_set_aside > 0


class JitterWorkflow(RolloutWorkflow):
    """Episodes of a random 0-20 ms, their tokens stamped with the version they started at."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def arun_episode(self, engine, data):
        ctx = wc.get()
        await asyncio.sleep(self.rng.random() * 0.02)
        return make_td(1, 4, reward=float(data.get("reward", ctx.sample_index)),
                       version=ctx.version)


def test_a_negative_oversample_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="oversample_groups"):
        _config(oversample_groups=-1)
