"""`ExternalSessionSource`: finalized sessions of external agents become the trainer's batches.

The gateway side is replaced by a recording stand-in here (these tests are about grouping,
staleness and acknowledgement); tests/service/ runs the real service end to end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from relayrl.rollout.external import ExternalSessionSource
from relayrl.trajectory import row_to_dict
from tests.train.test_trainer_ports import _two_turn_row


@dataclass
class FakeAdmin:
    """The admin routes the source uses, over an in-memory list of finalized sessions."""

    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    acked: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    exports: int = 0

    def finish(self, sid: str, reward: float, group: str | None = None, version: int = 0,
               calls: int = 1) -> None:
        row = _two_turn_row(sid, [reward, reward], seed=len(self.sessions))
        row = type(row)(**{**row.__dict__, "versions": [version if m else -1
                                                       for m in row.loss_mask]})
        self.sessions[sid] = {"info": {"session_id": sid, "group_id": group},
                              "rows": [row_to_dict(row)] if calls else []}

    async def finished_sessions(self) -> list[dict[str, Any]]:
        gone = set(self.acked) | set(self.aborted)
        return [s["info"] for sid, s in self.sessions.items() if sid not in gone]

    async def export(self, sid: str, **kw: Any) -> list[dict[str, Any]]:
        self.exports += 1
        return self.sessions[sid]["rows"]

    async def ack_export(self, sid: str) -> None:
        self.acked.append(sid)

    async def abort_session(self, sid: str) -> None:
        self.aborted.append(sid)


def _source(admin: FakeAdmin, version: list[int], **kw: Any) -> ExternalSessionSource:
    base = dict(group_size=2, batch_size=1, max_staleness=1, version_fn=lambda: version[0],
                export_style="concat", credit="discount", discount=1.0, poll_s=0.01,
                group_wait_s=60.0)
    return ExternalSessionSource(admin, **{**base, **kw})  # type: ignore[arg-type]


async def test_sessions_of_one_group_id_are_trained_together_and_acked_after_the_step() -> None:
    admin, version = FakeAdmin(), [0]
    admin.finish("a1", 1.0, group="q1")
    admin.finish("b1", 0.0, group="q2")
    admin.finish("a2", 0.0, group="q1")
    src = _source(admin, version)
    batch = await src.next_batch()
    assert set(batch.episode_ids) == {"a1", "a2"}
    assert len(set(batch.group_ids)) == 1 and batch.group_sizes == (2,)
    assert admin.acked == []  # not before the trainer is done with the batch
    admin.finish("b2", 1.0, group="q2")
    second = await src.next_batch()
    assert set(second.episode_ids) == {"b1", "b2"}
    assert sorted(admin.acked) == ["a1", "a2"]
    await src.__aexit__(None, None, None)
    assert sorted(admin.acked) == ["a1", "a2", "b1", "b2"]
    assert admin.exports == 4  # each session exported once, however often polled


async def test_sessions_without_a_group_are_grouped_in_arrival_order() -> None:
    admin, version = FakeAdmin(), [0]
    for i, r in enumerate([1.0, 0.0, 1.0, 1.0]):
        admin.finish(f"s{i}", r)
    src = _source(admin, version, batch_size=2)
    batch = await src.next_batch()
    assert batch.episode_ids == ("s0", "s1", "s2", "s3")
    assert batch.group_ids[0] == batch.group_ids[1] != batch.group_ids[2] == batch.group_ids[3]


async def test_a_stale_session_is_aborted_and_counted_never_trained() -> None:
    admin, version = FakeAdmin(), [3]
    admin.finish("old", 1.0, group="q", version=1)  # 2 versions behind, max_staleness 1
    admin.finish("new1", 1.0, group="q", version=2)
    admin.finish("new2", 0.0, group="q", version=3)
    src = _source(admin, version)
    batch = await src.next_batch()
    assert "old" not in batch.episode_ids and set(batch.episode_ids) == {"new1", "new2"}
    assert admin.aborted == ["old"] and src.counters.dropped_stale == 1


async def test_a_group_that_waited_long_enough_trains_with_what_it_has() -> None:
    admin, version, now = FakeAdmin(), [0], [0.0]
    admin.finish("lone", 1.0, group="q")
    src = _source(admin, version, group_wait_s=5.0, clock=lambda: now[0])
    await src.poll()
    assert src.stats().groups_queued == 0
    now[0] = 6.0
    await src.poll()
    assert src.stats().groups_queued == 1


async def test_stop_ends_next_batch_and_empty_sessions_are_freed() -> None:
    admin, version = FakeAdmin(), [0]
    admin.finish("nothing", 0.0, calls=0)
    src = _source(admin, version)
    await src.poll()
    assert admin.acked == ["nothing"] and src.counters.empty == 1
    src.stop()
    with pytest.raises(StopAsyncIteration):
        await src.next_batch()


async def test_a_session_of_two_roles_trains_each_role_in_its_own_group() -> None:
    admin, version = FakeAdmin(), [0]
    for sid, reward in (("a1", 1.0), ("a2", 0.0)):
        admin.finish(sid, reward, group="q1")
        row = admin.sessions[sid]["rows"][0]
        solver = {**row, "metadata": {**row["metadata"], "role": "solver"},
                  "interaction_ids": [f"{sid}-solver-{i}" for i in range(2)]}
        row["metadata"] = {**row["metadata"], "role": "planner"}
        admin.sessions[sid]["rows"].append(solver)
    src = _source(admin, version)
    batch = await src.next_batch()
    roles = [r.role for r in batch.rows.rows]
    assert sorted(set(zip(batch.group_ids, roles, strict=True))) == [
        ("grp:q1/planner", "planner"), ("grp:q1/solver", "solver")]
    from relayrl.train.packing import TrainBatch

    TrainBatch.from_row_batch(batch.rows)  # one role per group: the trainer takes it
    await src.__aexit__(None, None, None)
