"""`RolloutWorkflow`: one episode from one data item, and what an episode may return.

An episode returns a tensor dict (the RolloutWorkflow tensor format), a dict of `TrajectoryRow`s keyed by
interaction id (what the gateway exports), or `None` to reject itself. `to_rows` turns any of
these into one labelled `RowBatch` (torch-free rows), so everything after the episode (grouping,
batching, dumps, the trainer) handles a single form and nothing is lost on the way. Exceptions are not a return value: an episode that raises is
*aborted* by whoever runs it, and never becomes a row with reward 0.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, TypeGuard

from relayrl.errors import InvalidRequest
from relayrl.trajectory import TrajectoryRow
from relayrl.trajectory.batch import RowBatch
from relayrl.trajectory.roles import role_group_id
from relayrl.workflow.context import EpisodeContext
from relayrl.workflow.tensors import TensorDict, rows_from_tensor_dict

EpisodeResult = TensorDict | dict[str, TrajectoryRow] | None
"""What `arun_episode` returns: tensors, rows keyed by interaction id, or None (rejected)."""


class RolloutWorkflow(ABC):
    """Turns one data item into training rows."""

    @abstractmethod
    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> EpisodeResult:
        """Run one episode on `data`; return tensors, interaction rows, or None to reject it."""

    async def aclose(self) -> None:
        """Release what the workflow holds (process pools, clients); idempotent."""
        return None  # an optional hook: most workflows hold nothing

    def counters(self) -> dict[str, float]:
        """Cumulative counters this workflow keeps (e.g. checks it ran); reported per step."""
        return {}  # an optional hook: the rollout controller passes these on to the trainer


def is_interaction_dict(result: object) -> TypeGuard[Mapping[str, TrajectoryRow]]:
    """Whether `result` is a non-empty dict of `TrajectoryRow`s."""
    return (isinstance(result, Mapping) and bool(result)
            and all(isinstance(v, TrajectoryRow) for v in result.values()))


def to_rows(result: EpisodeResult, ctx: EpisodeContext) -> RowBatch | None:
    """One episode's result as labelled rows (None if rejected or empty).

    Rows that carry their own episode and group (in their metadata, or in the session metadata
    the agent workflow sets; tensor dicts in their label fields) keep them; everything else is
    labelled with `ctx`.
    """
    if result is None or (isinstance(result, Mapping) and not result):
        return None
    if is_interaction_dict(result):
        rows = list(result.values())
        return RowBatch(tuple(rows),
                        tuple(_row_label(r, "episode_id", ctx.episode_id) for r in rows),
                        tuple(_group_label(r, ctx.group_id) for r in rows))
    if isinstance(result, Mapping) and any(isinstance(v, TrajectoryRow)
                                           for v in result.values()):
        bad = next(k for k, v in result.items() if not isinstance(v, TrajectoryRow))
        raise InvalidRequest(f"interaction dict entry {bad!r} is not a TrajectoryRow")
    if not isinstance(result, Mapping):
        raise InvalidRequest(
            f"arun_episode returned a {type(result).__name__}; expected a tensor dict, "
            "a dict of TrajectoryRow keyed by interaction id, or None"
        )
    td: Mapping[str, Any] = result  # a tensor dict: the other shapes were handled above
    rows = rows_from_tensor_dict(td, ctx.episode_id, ctx.task_id or None)
    n = len(rows)
    episode_ids = tuple(td.get("episode_ids") or (ctx.episode_id,) * n)
    group_ids = tuple(td.get("group_ids") or (ctx.group_id,) * n)
    return RowBatch(tuple(rows), episode_ids, group_ids)


def _group_label(row: TrajectoryRow, default: str) -> str:
    """The row's group: relayrl's own group is split per role, per (task, role); a group the
    workflow named itself is kept (and refused by the trainer if it mixes roles)."""
    group = _row_label(row, "group_id", default)
    return role_group_id(group, row.role) if group == default else group


def _row_label(row: TrajectoryRow, key: str, default: str) -> str:
    """The row's own label (its metadata, then its session's metadata), else `default`."""
    session_meta = row.metadata.get("session")
    value = row.metadata.get(key) or (session_meta.get(key)
                                      if isinstance(session_meta, Mapping) else None)
    return str(value) if value else default
