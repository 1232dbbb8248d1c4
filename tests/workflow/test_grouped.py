"""Grouped episodes: the merge rules of tensor dicts and rows, per-row episode/group ids, isolated
contexts."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from relayrl.errors import EpisodeFailed, InvalidRequest
from relayrl.trajectory import TrajectoryRow
from relayrl.workflow import (
    EpisodeContext,
    EpisodeStatus,
    GroupedWorkflow,
    episode_scope,
    merge_results,
    run_episode,
    to_rows,
)
from relayrl.workflow import workflow_context as wc
from tests.workflow.helpers import LengthWorkflow, ScriptedWorkflow, make_td


def _row(iid: str, n: int = 4, reward: float = 1.0, meta: dict | None = None) -> TrajectoryRow:
    return TrajectoryRow(session_id="s-" + iid, task_id="t", segment_id="seg", style="individual",
                         interaction_ids=[iid], input_ids=list(range(1, n + 1)),
                         loss_mask=[0, 0] + [1] * (n - 2), logprobs=[0.0] * n,
                         versions=[-1, -1] + [0] * (n - 2), reward=reward,
                         turn_spans=[(2, n)], turn_rewards=[reward], metadata=meta or {})


def test_merging_drops_nones_and_all_nones_merge_to_none() -> None:
    assert merge_results([None, None, {}]) is None
    merged = merge_results([None, make_td(1, 3), None, make_td(2, 5)])
    assert merged["input_ids"].shape == (3, 5)


def test_interaction_dicts_merge_into_one_dict_and_duplicates_are_refused() -> None:
    merged = merge_results([{"a": _row("a")}, None, {"b": _row("b"), "c": _row("c")}])
    assert sorted(merged) == ["a", "b", "c"]
    with pytest.raises(InvalidRequest, match="'a'"):
        merge_results([{"a": _row("a")}, {"a": _row("a")}])


def test_a_group_mixing_rows_and_tensors_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="cannot merge"):
        merge_results([{"a": _row("a")}, make_td(1, 3)])


async def test_a_grouped_workflow_concatenates_members_and_labels_every_row() -> None:
    inner = LengthWorkflow(delay_s=0.01)
    merged = await GroupedWorkflow(inner, 4).arun_episode(None, {"seqlen": 3})
    assert merged["input_ids"].shape == (4, 6)  # member i has 3 + i tokens, padded to 6
    assert merged["attention_mask"].sum(dim=1).tolist() == [3, 4, 5, 6]
    assert len(set(merged["episode_ids"])) == 4
    assert len(set(merged["group_ids"])) == 1
    assert [c.episode_id for c in inner.seen] != [] and len(inner.seen) == 4
    assert {c.sample_index for c in inner.seen} == {0, 1, 2, 3}
    assert sorted(merged["episode_ids"]) == sorted(c.episode_id for c in inner.seen)


async def test_group_members_returning_rows_keep_their_episode_and_group() -> None:
    class RowsWorkflow(LengthWorkflow):
        async def arun_episode(self, engine, data):
            ctx = wc.get()
            return {ctx.episode_id: _row(ctx.episode_id)}

    merged = await GroupedWorkflow(RowsWorkflow(), 3).arun_episode(None, {})
    assert len(merged) == 3
    for iid, row in merged.items():
        assert row.metadata["episode_id"] == iid
    assert len({r.metadata["group_id"] for r in merged.values()}) == 1
    rows = to_rows(merged, EpisodeContext())
    assert sorted(rows.episode_ids) == sorted(merged)


async def test_a_group_of_rejections_is_none_and_some_rejections_are_dropped() -> None:
    wf = GroupedWorkflow(ScriptedWorkflow(), 3)
    assert await wf.arun_episode(None, {"plan": ["none"]}) is None
    merged = await wf.arun_episode(None, {"plan": ["ok", "none", "ok"]})
    assert merged["input_ids"].shape[0] == 2


async def test_a_member_that_raises_fails_the_grouped_episode_after_the_others_end() -> None:
    wf = GroupedWorkflow(ScriptedWorkflow(), 3)
    with pytest.raises(EpisodeFailed, match="agent crashed on purpose"):
        await wf.arun_episode(None, {"plan": ["ok", "raise", "ok"]})


@pytest.mark.parametrize(
    ("plan", "status", "error"),
    [
        ("ok", EpisodeStatus.FINISHED, None),
        ("none", EpisodeStatus.REJECTED, None),
        ("raise", EpisodeStatus.ABORTED, "ValueError: agent crashed on purpose"),
        ("hang", EpisodeStatus.ABORTED, "TimeoutError"),
        ("bad", EpisodeStatus.ABORTED, "'input_ids'"),
    ],
)
async def test_run_episode_tells_finished_rejected_and_aborted_apart(plan, status, error) -> None:
    ctx = EpisodeContext(task_id="7", episode_id="e", group_id="g")
    out = await run_episode(ScriptedWorkflow(), None, {"plan": [plan]}, ctx, timeout_s=0.2)
    assert out.status == status
    assert (out.rows is not None) == (status == EpisodeStatus.FINISHED)
    if error is None:
        assert out.error is None
    else:
        assert error in out.error
    if status == EpisodeStatus.FINISHED:
        assert out.rows.episode_ids == ("e",) and out.rows.group_ids == ("g",)


async def test_concurrent_episodes_each_see_only_their_own_context() -> None:
    seen: dict[str, str] = {}

    async def episode(i: int) -> None:
        ctx = EpisodeContext(task_id=str(i), episode_id=f"e{i}", is_eval=i % 2 == 1)
        with episode_scope(ctx):
            await asyncio.sleep(0.01 * (5 - i))
            seen[f"e{i}"] = f"{wc.get().task_id}/{wc.stat_scope()}"

    await asyncio.gather(*(episode(i) for i in range(5)))
    assert seen == {f"e{i}": f"{i}/{'eval-rollout' if i % 2 else 'rollout'}" for i in range(5)}
    assert wc.get() == EpisodeContext()  # nothing leaks out of the episodes


def test_a_context_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        EpisodeContext().task_id = "x"  # type: ignore[misc]


def test_a_group_of_one_still_labels_its_rows() -> None:
    async def go() -> dict:
        return await GroupedWorkflow(LengthWorkflow(), 1).arun_episode(None, {})

    merged = asyncio.run(go())
    assert len(merged["episode_ids"]) == 1 and merged["group_ids"][0].startswith("grp-")
    assert merged["rewards"].dtype == torch.float32
