"""Roles in training: groups per (task, role), a group mixing roles refused, advantages never
normalised across roles, and metrics per role in metrics.jsonl, TensorBoard's events and the PNG."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relayrl.errors import InvalidRequest
from relayrl.train.advantages import compute_advantages
from relayrl.train.config import TrainConfig
from relayrl.train.metrics import MetricsLogger, plot_training, role_metrics
from relayrl.train.packing import TrainBatch
from relayrl.trajectory import TrajectoryRow
from relayrl.trajectory.batch import RowBatch
from relayrl.workflow.base import to_rows
from relayrl.workflow.context import EpisodeContext


def _row(session: str, role: str | None, reward: float, task: str = "t1",
         group: str | None = None) -> TrajectoryRow:
    meta: dict = {} if role is None else {"role": role}
    if group is not None:
        meta["session"] = {"group_id": group}
    return TrajectoryRow(session_id=session, task_id=task, segment_id=f"seg-{session}",
                         style="individual", interaction_ids=[f"{session}-c"],
                         input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1],
                         logprobs=[0.0, 0.0, -0.5, -0.5], versions=[-1, -1, 0, 0],
                         reward=reward, turn_spans=[(2, 4)], turn_rewards=[reward], metadata=meta)


def test_rows_group_per_task_and_role_by_default() -> None:
    rows = [_row("a", "planner", 1.0), _row("b", "solver", 0.0), _row("c", None, 0.0)]
    tb = TrainBatch.from_rows(rows)
    assert tb.group_ids == ("t1/planner", "t1/solver", "t1")
    assert tb.roles == ("planner", "solver", None)
    assert tb.select([1]).roles == ("solver",)


def test_a_group_that_mixes_roles_is_refused_not_normalised() -> None:
    rows = [_row("a", "player_0", 1.0), _row("b", "player_1", -1.0)]
    with pytest.raises(InvalidRequest, match="holds rows of roles 'player_0' and 'player_1'"):
        TrainBatch.from_rows(rows, ["e1", "e2"], ["game", "game"])


def test_rows_without_roles_batch_as_before() -> None:
    tb = TrainBatch.from_rows([_row("a", None, 1.0), _row("b", None, 0.0)], ["e1", "e2"],
                              ["g", "g"])
    assert tb.roles is None and tb.group_ids == ("g", "g")


def test_advantages_are_normalised_within_each_role_only() -> None:
    # the planner's episodes earned 1 and 0, the solver's 20 and 10: each role's best episode
    # gets the same advantage; pooled, both planner episodes would sit far below the mean
    rows = [_row("p1", "planner", 1.0), _row("p2", "planner", 0.0),
            _row("s1", "solver", 20.0), _row("s2", "solver", 10.0)]
    tb = TrainBatch.from_rows(rows)
    adv = compute_advantages(tb, TrainConfig())
    per_row = adv.adv_B_T[:, 2]
    assert torch.allclose(per_row, torch.tensor([0.7071, -0.7071, 0.7071, -0.7071]), atol=1e-3)
    assert adv.stats["groups"] == 2.0


def test_the_rollout_labels_relayrls_own_group_per_role_and_keeps_a_named_one() -> None:
    ctx = EpisodeContext(task_id="t1", episode_id="ep-1", group_id="grp-1")
    batch = to_rows({"a": _row("a", "planner", 1.0), "b": _row("b", "solver", 0.0),
                     "c": _row("c", "solver", 0.0, group="grp-1:game")}, ctx)
    assert batch is not None
    assert batch.group_ids == ("grp-1/planner", "grp-1/solver", "grp-1:game")


def test_role_metrics_count_each_roles_episodes_once() -> None:
    rows = RowBatch((_row("p1", "planner", 1.0), _row("p1", "planner", 1.0),
                     _row("s1", "solver", 0.0), _row("s2", "solver", 1.0)),
                    ("e1", "e1", "e1", "e2"), ("g/planner", "g/planner", "g/solver", "g/solver"))
    m = role_metrics(rows)
    assert m["role/planner/reward_mean"] == 1.0 and m["role/planner/episodes"] == 1.0
    assert m["role/planner/rows"] == 2.0 and m["role/planner/trained_tokens"] == 4.0
    assert m["role/solver/reward_mean"] == 0.5 and m["role/solver/episodes"] == 2.0
    assert role_metrics(RowBatch((_row("x", None, 1.0),), ("e",), ("g",))) == {}


def test_role_metrics_reach_metrics_jsonl_tensorboard_and_the_png(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        for step, (p, s) in enumerate([(0.0, 1.0), (0.5, 0.5), (1.0, 0.0)], start=1):
            logger.log(step, {"reward_mean": (p + s) / 2, "role/planner/reward_mean": p,
                              "role/solver/reward_mean": s})
        records = logger.read()
    assert [r["role/planner/reward_mean"] for r in records] == [0.0, 0.5, 1.0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"role/planner/reward_mean", "role/solver/reward_mean"} <= set(events.Tags()["scalars"])
    with_roles = plot_training(records, tmp_path / "roles.png")
    without = plot_training([{k: v for k, v in r.items() if not k.startswith("role/")}
                             for r in records], tmp_path / "plain.png")
    assert with_roles.stat().st_size > 0
    assert with_roles.read_bytes() != without.read_bytes()  # the role panel was drawn
