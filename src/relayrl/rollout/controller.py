"""`RolloutController`: runs episodes over a dataset, concurrently, and hands the trainer batches.

One background task (the feeder) admits groups while three limits allow: not paused, running
episodes + one group <= `max_concurrent_rollouts`, and the staleness rule (`StalenessGate`).
Each group runs its `group_size` episodes at once; when all have ended, the group is *accepted*
if at least one episode finished with rows, else it is dropped (all rejected or aborted), and
its slot goes back. `next_batch` waits for `batch_size` accepted groups and returns them, oldest
first, as one `RowBatch` (torch-free rows with per-row episode and group ids) plus task ids;
the trainer makes tensors from it.

Aborted episodes (the agent raised, hung past the timeout, the engine or gateway failed) are
counted and their errors kept; their calls never reach a batch. Once `max_consecutive_aborts`
episodes in a row have aborted, nothing more is admitted and `next_batch` raises
`RolloutFailed` naming the last error, where it was raised, and the count: a workflow whose
every episode fails stops the run instead of relaunching episodes forever. Sessions and capacity are
released by the workflow on every path, including cancellation by `aclose`.

Tradeoff: a group is all-or-nothing for admission (its members start together, so they sample
from the same weights), which can leave up to `group_size - 1` concurrency slots idle.

The trainer says how many batches it will still take (`limit_batches`), so no episode runs for a
batch nobody takes: the last update gets the engine's cores instead of sampling a batch that is
cancelled when training ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from relayrl.errors import ConfigError, InvalidRequest, RolloutFailed
from relayrl.rollout.config import RolloutConfig
from relayrl.rollout.staleness import StalenessGate
from relayrl.trajectory.batch import RowBatch
from relayrl.workflow.base import RolloutWorkflow
from relayrl.workflow.context import EpisodeContext, episode_scope
from relayrl.workflow.dump import Decode, TrajectoryDumper
from relayrl.workflow.grouped import EpisodeOutcome, EpisodeStatus, GroupedWorkflow, new_group_id

log = logging.getLogger(__name__)

_POLL_S = 0.2
"""How often the feeder re-reads `version_fn` when nothing else wakes it."""
_KEEP_ERRORS = 32


def _episode_rewards(rows: RowBatch) -> list[float]:
    """Each episode's reward, in order of first row: the mean of its rows' rewards, as the
    trainer's group advantages count it."""
    per_episode: dict[str, list[float]] = {}
    for episode, reward in zip(rows.episode_ids, rows.rewards, strict=True):
        per_episode.setdefault(episode, []).append(reward)
    return [sum(r) / len(r) for r in per_episode.values()]


def uniform_group(rows: RowBatch, tol: float = 1e-6) -> bool:
    """True when every episode of the group got one reward: GRPO learns nothing from it."""
    means = _episode_rewards(rows)
    return bool(means) and max(means) - min(means) <= tol


@dataclass(frozen=True)
class RolloutStats:
    """Counters at one moment. Episode counts are cumulative; `running` is now."""

    version: int
    paused: bool
    running: int
    """Episodes in flight."""
    accepted: int
    """Episodes that finished with rows."""
    rejected: int
    """Episodes that returned None (or nothing)."""
    aborted: int
    """Episodes that raised, timed out or returned something malformed."""
    groups_running: int
    groups_accepted: int
    groups_dropped: int
    """Groups in which no episode finished with rows."""
    groups_set_aside: int
    """Groups whose episodes all got one reward, set aside by dynamic sampling (not batched)."""
    groups_queued: int
    """Accepted groups waiting for `next_batch`."""
    rows_out: int
    """Rows handed to the trainer."""
    mean_staleness: float
    """Over rows handed out: trainer version at hand-out minus the row's first sampled version."""
    recent_errors: tuple[str, ...] = ()
    """The last few abort errors, `episode_id: Type: message`."""
    aborted_by_reason: dict[str, int] = field(default_factory=dict)
    """Cumulative aborted episodes per reason (the error's type, e.g. `TimeoutError`)."""
    workflow: dict[str, float] = field(default_factory=dict)
    """The workflow's own cumulative counters (`RolloutWorkflow.counters`), e.g. the remote
    workflow's response_mask checks, mismatches and dropped rollouts."""


@dataclass(frozen=True)
class Batch:
    """Rows of complete groups, ready for the trainer."""

    rows: RowBatch
    """The rows, each with its episode and group id; a group's rows are contiguous."""
    task_ids: tuple[str, ...]
    group_sizes: tuple[int, ...]
    """Rows per group; a group's rows are contiguous, groups in `group_ids` order."""
    version: int
    """The controller's version when the batch was made."""
    staleness: tuple[int, ...]
    """Per row: `version` minus the version that sampled the row's first trained token."""
    stats: RolloutStats

    @property
    def num_rows(self) -> int:
        """Rows in the batch."""
        return self.rows.num_rows

    @property
    def episode_ids(self) -> tuple[str, ...]:
        """Per row: the episode it came from."""
        return self.rows.episode_ids

    @property
    def group_ids(self) -> tuple[str, ...]:
        """Per row: its group (the episodes sampled for one data item)."""
        return self.rows.group_ids


@dataclass
class _Group:
    task_id: str
    admitted_version: int
    rows: RowBatch


class RolloutController:
    """Runs `workflow` over `dataset` under `config`; `await next_batch()` for training rows.

    `version_fn` (if given) is read whenever admission is decided; otherwise the version is
    whatever `set_version` last said. `engine` is passed to every `arun_episode` (the launchers
    hand the run's `RunEngine`; agents ignore it).
    """

    def __init__(self, workflow: RolloutWorkflow, dataset: Sequence[dict[str, Any]],
                 config: RolloutConfig, version_fn: Callable[[], int] | None = None, *,
                 engine: Any = None, decode: Decode | None = None) -> None:
        if not len(dataset):
            raise InvalidRequest("the dataset is empty")
        if isinstance(workflow, GroupedWorkflow):
            if workflow.group_size != config.group_size:
                raise ConfigError(f"the workflow is grouped by {workflow.group_size} but "
                                  f"config.group_size is {config.group_size}")
            self._group = workflow
        else:
            self._group = GroupedWorkflow(workflow, config.group_size)
        self.dataset = dataset
        self.config = config
        self.engine = engine
        self._version_fn = version_fn
        self._version = 0
        self._gate = StalenessGate(config.batch_size, config.max_staleness)
        self._dumper = (TrajectoryDumper(config.dump_root, config.experiment, config.trial,
                                         decode) if config.dump_root else None)
        self._order = self._data_order()
        self._exhausted = False
        self._paused = False
        self._ready: deque[_Group] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._feeder: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._next_task_id = 0
        self._counts = {s: 0 for s in EpisodeStatus}
        self._running_episodes = 0
        self._groups_dropped = 0
        self._groups_set_aside = 0
        self._set_aside_since_batch = 0
        self._groups_out = 0
        """Groups handed out in batches."""
        self._group_cap: int | None = None
        """`limit_batches`: most groups ever accepted or running (None: only staleness limits)."""
        self._rows_out = 0
        self._staleness_sum = 0
        self._errors: deque[str] = deque(maxlen=_KEEP_ERRORS)
        self._abort_reasons: Counter[str] = Counter()
        self._aborts_in_a_row = 0
        self._failure: RolloutFailed | None = None
        """Set once `max_consecutive_aborts` episodes in a row aborted: nothing more is
        admitted and `next_batch` raises it."""
        self._bar = tqdm(desc="rollout", unit="ep", disable=not config.progress, leave=False)
        self._closed = False

    # ---- version, pause ---------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The weight version admission is decided against."""
        return self._version_fn() if self._version_fn is not None else self._version

    def set_version(self, version: int) -> None:
        """The trainer's new version (after a weight update); wakes admission."""
        self._version = version
        self._poke()

    def pause(self) -> None:
        """Admit no new groups (running ones go on); call around weight updates."""
        self._paused = True

    def resume(self) -> None:
        """Admit groups again."""
        self._paused = False
        self._poke()

    def limit_batches(self, remaining: int | None) -> None:
        """Admit groups for at most `remaining` more batches than handed out so far (None: any).

        Dynamic sampling's replacements still run (a set-aside group frees its place)."""
        if remaining is not None and remaining < 0:
            raise InvalidRequest(f"remaining batches must be >= 0; got {remaining}")
        self._group_cap = (None if remaining is None
                           else self._groups_out + remaining * self.config.batch_size)
        self._poke()

    def _limit(self, version: int) -> int:
        """Most groups accepted or running at `version`: the staleness rule, and the trainer's
        remaining batches."""
        limit = self._gate.limit(version)
        return limit if self._group_cap is None else min(limit, self._group_cap)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ---- admission --------------------------------------------------------------------------

    def _data_order(self) -> Iterator[int]:
        """Dataset indices, epoch after epoch (shuffled per epoch if configured)."""
        epoch = 0
        while self.config.epochs is None or epoch < self.config.epochs:
            order = list(range(len(self.dataset)))
            if self.config.shuffle:
                random.Random((self.config.seed or 0) + epoch).shuffle(order)
            yield from order
            epoch += 1

    def start(self) -> None:
        """Start admitting episodes (next_batch does this on first use); needs a running loop."""
        if self._closed:
            raise InvalidRequest("the controller is closed")
        if self._feeder is None:
            self._wake, self._changed = asyncio.Event(), asyncio.Event()
            self._feeder = asyncio.create_task(self._feed(), name="relayrl-rollout-feeder")

    async def _feed(self) -> None:
        # runs until the data is exhausted or aclose stops it; each pass admits what fits
        while not self._closed and not (self._exhausted and not self._tasks):
            assert self._wake is not None
            self._wake.clear()
            self._admit_what_fits()
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that arrives
            # as the event fires, and the feeder would outlive aclose
            with contextlib.suppress(TimeoutError):  # on timeout: re-read version_fn
                async with asyncio.timeout(_POLL_S):
                    await self._wake.wait()
        self._notify()

    def _admit_what_fits(self) -> None:
        g = self.config.group_size
        version = self.version
        while (not self._paused and not self._exhausted and self._failure is None
               and self._running_episodes + g <= self.config.max_concurrent_rollouts
               and self._gate.submitted < self._limit(version)):
            index = next(self._order, None)
            if index is None:
                self._exhausted = True
                break
            self._gate.admit(version)
            seq = self._next_task_id
            self._next_task_id += 1
            self._running_episodes += g
            task = asyncio.create_task(self._run_group(seq, self.dataset[index], version))
            self._tasks.add(task)
            task.add_done_callback(self._group_done)

    def _group_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._poke()  # the feeder may be waiting for the last group to end the data

    async def _run_group(self, seq: int, data: dict[str, Any], version: int) -> None:
        task_id = str(seq)
        ctx = EpisodeContext(task_id=task_id, group_id=new_group_id(),
                             is_eval=self.config.is_eval, version=version)
        ended = 0
        group: _Group | None = None
        ran = False  # False: cancelled (aclose)

        def on_done(outcome: EpisodeOutcome) -> None:
            nonlocal ended
            ended += 1
            self._episode_done(outcome)

        try:
            with episode_scope(ctx):
                outcomes = await self._group.run_members(
                    self.engine, data, self.config.episode_timeout_s, on_done=on_done)
            finished = [o for o in outcomes if o.status == EpisodeStatus.FINISHED]
            if finished:
                group = _Group(task_id, version,
                               RowBatch.concat(o.rows for o in finished if o.rows is not None))
            ran = True
        except Exception as e:  # a bug above the episodes (merging): drop the group
            log.exception("group %s failed", task_id)
            self._errors.append(f"group {task_id}: {type(e).__name__}: {e}")
            ran = True
        finally:
            # members counted in _running_episodes at admission but never reported
            self._running_episodes -= self.config.group_size - ended
            self._settle(group, ran)
            self._poke()
            self._notify()

    def _settle(self, group: _Group | None, ran: bool) -> None:
        """Batch, set aside or drop an ended group; its staleness slot follows."""
        accepted = False
        if not ran:
            pass  # cancelled by aclose: neither trained nor counted
        elif group is None:
            self._groups_dropped += 1
        elif self._set_aside(group.rows):
            self._groups_set_aside += 1
            self._set_aside_since_batch += 1
        else:
            self._ready.append(group)
            accepted = True
            self._dump(group)
        self._gate.finish(accepted)

    def _set_aside(self, rows: RowBatch) -> bool:
        """Dynamic sampling: True for a uniform group while this batch's budget lasts."""
        cfg = self.config
        if not cfg.dynamic_sampling or cfg.is_eval:
            return False
        if self._set_aside_since_batch >= cfg.dynamic_sampling_budget * cfg.batch_size:
            return False  # spent: batch it; the trainer drops it if drop_uniform_groups is on
        return uniform_group(rows)

    def _episode_done(self, outcome: EpisodeOutcome) -> None:
        self._counts[outcome.status] += 1
        self._running_episodes -= 1
        if outcome.status == EpisodeStatus.ABORTED:
            first_line = (outcome.error or "").splitlines()[0] if outcome.error else ""
            self._errors.append(f"{outcome.ctx.episode_id}: {first_line}")
            self._abort_reasons[first_line.split(":", 1)[0].strip() or "unknown"] += 1
            self._aborts_in_a_row += 1
            if self._failure is None:
                log.warning("episode %s aborted: %s", outcome.ctx.episode_id, first_line)
                self._check_failing(outcome)
        else:
            self._aborts_in_a_row = 0
        self._bar.update(1)
        s = self._counts
        self._bar.set_postfix(run=self._running_episodes, ok=s[EpisodeStatus.FINISHED],
                              rej=s[EpisodeStatus.REJECTED], abort=s[EpisodeStatus.ABORTED],
                              stale=f"{self._mean_staleness():.2f}", refresh=False)

    def _check_failing(self, outcome: EpisodeOutcome) -> None:
        """Stop the rollouts once `max_consecutive_aborts` episodes in a row have aborted."""
        limit = self.config.max_consecutive_aborts
        if limit is None or self._aborts_in_a_row < limit:
            return
        error = (outcome.error or "unknown error").splitlines()[0]
        where = f", raised at {outcome.where}" if outcome.where else ""
        reasons = ", ".join(f"{k}: {v}" for k, v in self._abort_reasons.most_common())
        self._failure = RolloutFailed(
            f"{self._aborts_in_a_row} episodes in a row aborted with none finishing "
            f"(rollout.max_consecutive_aborts: {limit}); the last: {error}{where}. Aborted "
            f"episodes by error so far: {reasons}. Fix the workflow, or raise "
            "rollout.max_consecutive_aborts if its episodes may fail this often")
        log.error("rollouts stopped: %s", self._failure)
        self._notify()
        self._poke()

    def _dump(self, group: _Group) -> None:
        if self._dumper is None:
            return
        try:
            self._dumper.dump(group.rows, group.task_id, self.version, self.config.is_eval)
        except OSError as e:  # a full disk must not stop training
            log.warning("could not dump group %s: %s", group.task_id, e)
        except Exception:  # nor a bug in dumping: the group is trained on all the same
            log.exception("could not dump group %s", group.task_id)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    # ---- batches ----------------------------------------------------------------------------

    async def next_batch(self) -> Batch:
        """The next `batch_size` accepted groups (fewer at the end of the data).

        Raises StopAsyncIteration once the data is exhausted and every group handed out.
        """
        self.start()
        assert self._changed is not None and self._feeder is not None
        while len(self._ready) < self.config.batch_size:  # ends: groups finish or data ends
            if self._failure is not None:
                raise self._failure
            if self._feeder.done():
                self._feeder.result()  # re-raise a feeder failure
                if not self._ready:
                    raise StopAsyncIteration
                break
            self._changed.clear()
            await self._changed.wait()
        take = min(self.config.batch_size, len(self._ready))
        groups = [self._ready.popleft() for _ in range(take)]
        return self._make_batch(groups)

    def _make_batch(self, groups: list[_Group]) -> Batch:
        merged = RowBatch.concat(g.rows for g in groups)
        version = self.version
        heads = merged.head_versions()
        admitted = [g.admitted_version for g in groups for _ in range(g.rows.num_rows)]
        staleness = tuple(version - (h if h >= 0 else a)
                          for h, a in zip(heads, admitted, strict=True))
        self._rows_out += len(staleness)
        self._groups_out += len(groups)
        self._staleness_sum += sum(staleness)
        self._set_aside_since_batch = 0
        self._poke()  # handing out frees no slot, but the trainer may bump the version next
        return Batch(
            rows=merged,
            task_ids=tuple(g.task_id for g in groups for _ in range(g.rows.num_rows)),
            group_sizes=tuple(g.rows.num_rows for g in groups),
            version=version,
            staleness=staleness,
            stats=self.stats(),
        )

    def __aiter__(self) -> RolloutController:
        return self

    async def __anext__(self) -> Batch:
        return await self.next_batch()

    # ---- stats, shutdown --------------------------------------------------------------------

    def _mean_staleness(self) -> float:
        return self._staleness_sum / self._rows_out if self._rows_out else 0.0

    def stats(self) -> RolloutStats:
        """Counters now."""
        s = self._counts
        return RolloutStats(
            version=self.version, paused=self._paused, running=self._running_episodes,
            accepted=s[EpisodeStatus.FINISHED], rejected=s[EpisodeStatus.REJECTED],
            aborted=s[EpisodeStatus.ABORTED], groups_running=self._gate.running,
            groups_accepted=self._gate.accepted, groups_dropped=self._groups_dropped,
            groups_set_aside=self._groups_set_aside, groups_queued=len(self._ready), rows_out=self._rows_out,
            mean_staleness=self._mean_staleness(), recent_errors=tuple(self._errors),
            aborted_by_reason=dict(self._abort_reasons), workflow=self._workflow_counters(),
        )

    def _workflow_counters(self) -> dict[str, float]:
        try:
            return {str(k): float(v) for k, v in self._group.counters().items()}
        except Exception:  # a broken counter must not stop training: log it, report none
            log.exception("the workflow's counters() failed")
            return {}

    @property
    def gate(self) -> StalenessGate:
        """The staleness counter (read-only use: tests and metrics)."""
        return self._gate

    async def aclose(self) -> None:
        """Stop admitting, cancel running episodes (their sessions are released), close all."""
        self._closed = True
        pending = [t for t in (self._feeder, *self._tasks) if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._group.aclose()
        self._bar.close()

    async def __aenter__(self) -> RolloutController:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

