"""`ExternalSessionSource`: batches of trajectories that agents outside relayrl drove themselves.

Agents anywhere start sessions on the service, make their LLM calls, set rewards and finalize.
This source turns those finalized sessions into the trainer's batches (it is a `BatchSource`,
so the trainer is the same one `relayrl train` runs):

- It polls the gateway's admin route for finalized, not yet exported sessions and exports each
  one once (export is a pure read on the gateway until acknowledged).
- **Groups.** Sessions that carry a `group_id` (or a `task_id`) are trained together once
  `group_size` of them have finalized, or once the first of them has waited `group_wait_s`.
  Sessions without one are grouped in the order they finish, `group_size` at a time, and each is
  normalized against the others of its group: a baseline from sessions sampled under about the
  same weights. An all-time running mean would mix in rewards of older policies and lag behind.
- **Staleness, per session.** A session whose first sampled token came from version `v` is
  trained only while `current - v <= max_staleness`; older ones are aborted on the gateway
  (their budget goes back), counted and logged, never silently dropped.
- **Exactly once.** Sessions of a batch are acknowledged when the trainer asks for the next batch
  (its step is done by then). After a crash, unacknowledged sessions come back from the
  gateway's log and are trained then; an acknowledged one is never handed out again.

Imports: client, trajectory, rollout's own records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relayrl.client import SessionClient
from relayrl.errors import ConfigError
from relayrl.rollout.controller import Batch, RolloutStats
from relayrl.trajectory import SCHEMA_VERSION, row_from_dict
from relayrl.trajectory.batch import RowBatch
from relayrl.trajectory.roles import role_group_id

log = logging.getLogger(__name__)

_KEEP_REWARDS = 256


@dataclass(frozen=True)
class ExternalConfig:
    """How finalized sessions of external agents become batches (`relayrl serve`).

    Group size, batch size and staleness are the rollout section's, the session TTL the
    gateway's, when to checkpoint the trainer's: one definition each.
    """

    group_wait_s: float = 120.0          # a group trains with fewer than group_size members after this
    poll_s: float = 0.25                 # how often finalized sessions are collected

    def __post_init__(self) -> None:
        for name in ("group_wait_s", "poll_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class _Pending:
    """Finalized sessions of one group, waiting for the rest of it."""

    first_seen: float
    members: list[tuple[str, RowBatch]] = field(default_factory=list)


@dataclass
class SourceCounters:
    """What the source has seen (shown by `/rl/v1/status`)."""

    trained: int = 0
    dropped_stale: int = 0
    empty: int = 0
    batches: int = 0
    recent_rewards: deque[float] = field(default_factory=lambda: deque(maxlen=_KEEP_REWARDS))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready counters, with the mean reward of recent trajectories."""
        recent = list(self.recent_rewards)
        return {"trajectories_trained": self.trained, "dropped_stale": self.dropped_stale,
                "empty_sessions": self.empty, "batches": self.batches,
                "recent_reward_mean": sum(recent) / len(recent) if recent else None,
                "recent_reward_count": len(recent)}


class ExternalSessionSource:
    """Batches of `batch_size` groups of finalized sessions from a gateway's admin API."""

    def __init__(self, client: SessionClient, *, group_size: int, batch_size: int,
                 max_staleness: int, version_fn: Callable[[], int], export_style: str,
                 credit: str, discount: float, group_wait_s: float = 120.0,
                 poll_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.group_size = group_size
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.version_fn = version_fn
        self.export_style = export_style
        self.credit = credit
        self.discount = discount
        self.group_wait_s = group_wait_s
        self.poll_s = poll_s
        self.counters = SourceCounters()
        self._clock = clock
        self._seen: set[str] = set()
        self._pending: dict[str, _Pending] = {}
        self._ungrouped: deque[tuple[str, RowBatch]] = deque()
        self._ready: deque[tuple[str, list[tuple[str, RowBatch]]]] = deque()
        self._to_ack: list[str] = []
        self._stop = asyncio.Event()
        self._next_ungrouped = 0

    # ---- BatchSource -------------------------------------------------------------------------

    async def next_batch(self) -> Batch:
        """The next batch; raises StopAsyncIteration once `stop()` was called."""
        await self._ack_previous()
        while len(self._ready) < self.batch_size:  # ends on enough groups or on stop()
            if self._stop.is_set():
                raise StopAsyncIteration
            await self.poll()
            if len(self._ready) >= self.batch_size:
                break
            try:
                async with asyncio.timeout(self.poll_s):
                    await self._stop.wait()
            except TimeoutError:
                pass
        groups = [self._ready.popleft() for _ in range(self.batch_size)]
        return self._make_batch(groups)

    def stats(self) -> RolloutStats:
        """Counters in the rollout controller's shape (the trainer logs a few of them)."""
        c = self.counters
        waiting = sum(len(p.members) for p in self._pending.values()) + len(self._ungrouped)
        return RolloutStats(
            version=self.version_fn(), paused=self._stop.is_set(), running=waiting,
            accepted=c.trained, rejected=c.empty, aborted=c.dropped_stale, groups_running=0,
            groups_accepted=c.batches * self.batch_size, groups_dropped=0, groups_set_aside=0,
            groups_queued=len(self._ready), rows_out=c.trained, mean_staleness=0.0,
            aborted_by_reason={"stale": c.dropped_stale} if c.dropped_stale else {})

    async def __aenter__(self) -> ExternalSessionSource:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._ack_previous()

    def stop(self) -> None:
        """Hand out no more batches: `next_batch` raises StopAsyncIteration from now on."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        """Whether `stop()` was called."""
        return self._stop.is_set()

    # ---- collecting --------------------------------------------------------------------------

    async def poll(self) -> None:
        """Take in newly finalized sessions and move complete groups to the ready queue."""
        for info in await self.client.finished_sessions():
            sid = info["session_id"]
            if sid in self._seen:
                continue
            self._seen.add(sid)
            await self._take(sid, info)
        self._promote_groups()

    async def _take(self, sid: str, info: dict[str, Any]) -> None:
        raw = await self.client.export(sid, style=self.export_style, credit=self.credit,
                                       discount=self.discount)
        rows = [row_from_dict({"schema_version": SCHEMA_VERSION, **r}) for r in raw]
        if not rows:  # a session that made no call: nothing to learn from
            self.counters.empty += 1
            await self.client.ack_export(sid)
            return
        heads = [v for v in RowBatch.of_episode(rows, sid, sid).head_versions() if v >= 0]
        sampled_at = min(heads) if heads else self.version_fn()
        lag = self.version_fn() - sampled_at
        if lag > self.max_staleness:
            self.counters.dropped_stale += 1
            log.warning("session %s dropped: sampled at version %d, %d versions behind "
                        "(max_staleness %d)", _short(sid), sampled_at, lag, self.max_staleness)
            await self.client.abort_session(sid)
            return
        group = info.get("group_id") or info.get("task_id")
        if group:
            pending = self._pending.setdefault(str(group), _Pending(self._clock()))
            pending.members.append((sid, _per_role(RowBatch.of_episode(rows, sid,
                                                                        f"grp:{group}"))))
        else:
            self._ungrouped.append((sid, RowBatch.of_episode(rows, sid, "")))

    def _promote_groups(self) -> None:
        now = self._clock()
        for key in list(self._pending):
            p = self._pending[key]
            if len(p.members) >= self.group_size or now - p.first_seen >= self.group_wait_s:
                self._ready.append((key, p.members))
                del self._pending[key]
        while len(self._ungrouped) >= self.group_size:
            gid = f"ungrouped:{self._next_ungrouped}"
            self._next_ungrouped += 1
            members = [self._ungrouped.popleft() for _ in range(self.group_size)]
            relabelled = [(sid, _per_role(RowBatch(rb.rows, rb.episode_ids,
                                                   (gid,) * rb.num_rows)))
                          for sid, rb in members]
            self._ready.append((gid, relabelled))

    def _make_batch(self, groups: list[tuple[str, list[tuple[str, RowBatch]]]]) -> Batch:
        version = self.version_fn()
        parts = [rb for _, members in groups for _, rb in members]
        rows = RowBatch.concat(parts)
        self._to_ack = [sid for _, members in groups for sid, _ in members]
        self.counters.trained += len(self._to_ack)
        self.counters.batches += 1
        for _, members in groups:
            for _, rb in members:
                self.counters.recent_rewards.append(rb.rows[-1].reward)
        heads = rows.head_versions()
        return Batch(
            rows=rows,
            task_ids=tuple(key for key, members in groups for _, rb in members
                           for _ in range(rb.num_rows)),
            group_sizes=tuple(sum(rb.num_rows for _, rb in members) for _, members in groups),
            version=version,
            staleness=tuple(version - h if h >= 0 else 0 for h in heads),
            stats=self.stats(),
        )

    async def _ack_previous(self) -> None:
        ids, self._to_ack = self._to_ack, []
        for sid in ids:
            try:
                await self.client.ack_export(sid)
            except Exception as e:  # gone already (TTL, restart): nothing left to free
                log.debug("ack of %s failed: %s", _short(sid), e)


def _per_role(rows: RowBatch) -> RowBatch:
    """`rows` with each group split per role: advantages are per (task, role)."""
    return RowBatch(rows.rows, rows.episode_ids,
                    tuple(role_group_id(g, r.role)
                          for g, r in zip(rows.group_ids, rows.rows, strict=True)))


def _short(session_id: str) -> str:
    """A log-safe prefix of a session id (ids are not secrets, but keep lines short)."""
    return session_id[:13]
