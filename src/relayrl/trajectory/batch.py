"""`RowBatch`: training rows with the episode and group each came from, as plain Python.

This is the one record that carries trajectories from a workflow to the trainer: an episode
returns rows (or a tensor dict, converted at that edge by `relayrl.workflow`), the rollout
controller groups and batches them, and the trainer makes tensors once, in `relayrl.train`.
Because it holds `TrajectoryRow`s rather than padded tensors, nothing is lost on the way (turn
spans and per-turn rewards reach the trainer) and the layers in between need no torch.

Imports: trajectory records only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from relayrl.errors import InvalidRequest
from relayrl.trajectory.export import TrajectoryRow
from relayrl.types import PROMPT_VERSION


@dataclass(frozen=True)
class RowBatch:
    """Rows and, per row, the ids of its episode and its group (advantages are per group)."""

    rows: tuple[TrajectoryRow, ...]
    episode_ids: tuple[str, ...]
    group_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        n = len(self.rows)
        if len(self.episode_ids) != n or len(self.group_ids) != n:
            raise InvalidRequest(f"RowBatch: {n} rows but {len(self.episode_ids)} episode ids "
                                 f"and {len(self.group_ids)} group ids")

    @classmethod
    def of_episode(cls, rows: Sequence[TrajectoryRow], episode_id: str,
                   group_id: str) -> RowBatch:
        """All `rows` labelled with one episode and group."""
        n = len(rows)
        return cls(tuple(rows), (episode_id,) * n, (group_id,) * n)

    @classmethod
    def concat(cls, parts: Iterable[RowBatch]) -> RowBatch:
        """Parts one after the other (groups stay contiguous)."""
        parts = list(parts)
        return cls(tuple(r for p in parts for r in p.rows),
                   tuple(e for p in parts for e in p.episode_ids),
                   tuple(g for p in parts for g in p.group_ids))

    @property
    def num_rows(self) -> int:
        """Rows in the batch."""
        return len(self.rows)

    @property
    def rewards(self) -> tuple[float, ...]:
        """Each row's credited reward."""
        return tuple(r.reward for r in self.rows)

    @property
    def max_tokens(self) -> int:
        """Length of the longest row."""
        return max((r.num_tokens for r in self.rows), default=0)

    def head_versions(self) -> tuple[int, ...]:
        """Per row, the version that sampled its first trained token (-1 when it has none)."""
        return tuple(_head_version(r) for r in self.rows)


def _head_version(row: TrajectoryRow) -> int:
    for m, v in zip(row.loss_mask, row.versions, strict=True):
        if m and v >= 0:
            return v
    return PROMPT_VERSION
