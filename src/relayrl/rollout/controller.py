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

Oversampling (`oversample_groups`, with dynamic sampling): groups beyond the staleness rule's
room start at once, so a uniform group's replacement is already running when it ends. Groups are
then settled in admission order, not as they end: a batch holds the first groups (by data order)
that carry signal, as if they had been sampled one after another, so short episodes are not
preferred. A group whose place in that order would make it staler than `max_staleness` when
trained (its accepted index past the limit at its admission version) is discarded, or cancelled
while it still runs: the staleness bound holds as without oversampling.

Growth (`grow_uniform_groups`): a group whose episodes all got one reward runs `group_size` more
episodes of its item, round by round, before it is settled, and trains as one group. A round
takes the slots the group's own episodes freed; should others hold them, it waits and the feeder
admits no new group meanwhile.

A running baseline (`baseline_by`): the controller keeps, per value of an item field, the rewards
of the last episodes it ended. A uniform group far enough from its value's mean is trained
instead of set aside, and the batch carries that mean as the group's baseline (`Batch.baselines`):
GRPO's group mean is then no baseline at all, but the policy's recent record on such items is.

The trainer says how many batches it will still take (`limit_batches`), so no episode runs for a
batch nobody takes: the last update gets the engine's cores instead of sampling a batch that is
cancelled when training ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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


def _has_signal(outcomes: list[EpisodeOutcome]) -> bool | None:
    """Whether the finished episodes' rewards differ (None: none finished with rows)."""
    rows = [o.rows for o in outcomes if o.status == EpisodeStatus.FINISHED and o.rows is not None]
    return None if not rows else not uniform_group(RowBatch.concat(rows))


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
    groups_discarded: int = 0
    """Oversampled groups with no room left under the staleness bound (discarded or cancelled)."""
    groups_baselined: int = 0
    """Uniform groups trained against their item kind's running mean (`baseline_by`)."""
    groups_grown: int = 0
    """Times a uniform group ran `group_size` more episodes of its item (`grow_uniform_groups`)."""
    grown_groups_with_signal: int = 0
    """Groups that were grown and then ended with a spread of rewards."""
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
    baselines: dict[str, float] = field(default_factory=dict)
    """Group id -> the baseline its advantages take instead of the group's mean (uniform groups
    kept by `baseline_by`); groups not named here use their own mean."""

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
    kind: str | None = None
    """The item's `baseline_by` value (JSON), None without a running baseline."""
    baseline: float | None = None
    """Set when the group is uniform and trains against its kind's running mean."""


@dataclass
class _Running:
    task: asyncio.Task[None]
    admitted_version: int
    started: bool = False
    """Its coroutine runs: cancelling it now reaches its `finally` (before, nothing would)."""


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
        self._order = self._data_order(self._strata())
        self._history: dict[str, deque[float]] = {}
        """`baseline_by`: per item kind, the rewards of its last episodes (oldest first)."""
        if config.baseline_by is not None and not config.is_eval:
            for index, item in enumerate(dataset):
                if config.baseline_by not in item:
                    raise ConfigError(f"baseline_by={config.baseline_by!r}: item {index} has no "
                                      "such field")
        self._groups_baselined = 0
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
        self._oversample = (config.oversample_groups
                            if config.dynamic_sampling and not config.is_eval else 0)
        self._groups_discarded = 0
        self._groups_grown = 0
        self._grown_with_signal = 0
        self._growths_waiting = 0
        """Groups waiting for room to grow: the feeder admits no new group meanwhile."""
        self._freed: asyncio.Event | None = None
        self._running: dict[int, _Running] = {}
        """Groups not settled yet, by admission number."""
        self._ended: dict[int, _Group | None] = {}
        """Oversampling: groups that ended and wait for their turn (None: nothing to train)."""
        self._cursor = 0
        """Oversampling: the admission number settled next."""
        self._cancelled: set[int] = set()
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

    def _data_order(self, strata: list[list[int]] | None) -> Iterator[int]:
        """Dataset indices, epoch after epoch (shuffled per epoch if configured; strata in turn)."""
        epoch = 0
        while self.config.epochs is None or epoch < self.config.epochs:
            rng = random.Random((self.config.seed or 0) + epoch)
            if strata is None:
                order = list(range(len(self.dataset)))
                if self.config.shuffle:
                    rng.shuffle(order)
            else:
                queues = [list(stratum) for stratum in strata]
                if self.config.shuffle:
                    for queue in queues:
                        rng.shuffle(queue)
                # round-robin: a short stratum runs out and the others go on
                order = [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]
            yield from order
            epoch += 1

    def _strata(self) -> list[list[int]] | None:
        """Dataset indices by the value of `stratify_by`, values in order of first appearance."""
        key = self.config.stratify_by
        if key is None:
            return None
        strata: dict[str, list[int]] = {}
        for index, item in enumerate(self.dataset):
            if key not in item:
                raise ConfigError(f"stratify_by={key!r}: item {index} has no such field")
            strata.setdefault(json.dumps(item[key], sort_keys=True), []).append(index)
        return list(strata.values())

    def start(self) -> None:
        """Start admitting episodes (next_batch does this on first use); needs a running loop."""
        if self._closed:
            raise InvalidRequest("the controller is closed")
        if self._feeder is None:
            self._wake, self._changed = asyncio.Event(), asyncio.Event()
            self._freed = asyncio.Event()
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

    def _room(self, version: int) -> bool:
        """The staleness rule admits another group, or oversampling does."""
        gate = self._gate
        if gate.submitted < self._limit(version):
            return True
        # an oversampled group admitted now must still fit the bound if every earlier one fails
        return (gate.submitted < self._limit(version) + self._oversample
                and not self._past_bound(version))

    def _admit_what_fits(self) -> None:
        g = self.config.group_size
        version = self.version
        while (not self._paused and not self._exhausted and not self._growths_waiting
               and self._failure is None
               and self._running_episodes + g <= self.config.max_concurrent_rollouts
               and self._room(version)):
            index = next(self._order, None)
            if index is None:
                self._exhausted = True
                break
            if self._gate.submitted < self._limit(version):
                self._gate.admit(version)
            else:
                self._gate.add()  # oversampled: settled in order, discarded if past the bound
            seq = self._next_task_id
            self._next_task_id += 1
            self._running_episodes += g
            task = asyncio.create_task(self._run_group(seq, self.dataset[index], version))
            self._running[seq] = _Running(task, version)
            self._tasks.add(task)
            task.add_done_callback(self._group_done)

    def _group_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._poke()  # the feeder may be waiting for the last group to end the data

    async def _run_group(self, seq: int, data: dict[str, Any], version: int) -> None:
        task_id = str(seq)
        ctx = EpisodeContext(task_id=task_id, group_id=new_group_id(),
                             is_eval=self.config.is_eval, version=version)
        self._running[seq].started = True
        ended = 0
        members = self.config.group_size  # counted in _running_episodes at admission
        group: _Group | None = None
        ran = False  # False: cancelled (oversampling's discard, or aclose)

        def on_done(outcome: EpisodeOutcome) -> None:
            nonlocal ended
            ended += 1
            self._episode_done(outcome)

        try:
            if self._oversample and self._past_bound(version):
                return  # became hopeless before it started (not ran: settled as discarded)
            with episode_scope(ctx):
                outcomes = await self._group.run_members(
                    self.engine, data, self.config.episode_timeout_s, on_done=on_done)
                while self._may_grow(outcomes):  # bounded: grow_uniform_groups rounds at most
                    await self._room_to_grow()
                    members += self.config.group_size
                    self._running_episodes += self.config.group_size
                    self._groups_grown += 1
                    outcomes += await self._group.run_members(
                        self.engine, data, self.config.episode_timeout_s, on_done=on_done,
                        first_index=len(outcomes))
                if len(outcomes) > self.config.group_size:
                    self._grown_with_signal += bool(_has_signal(outcomes))
            finished = [o for o in outcomes if o.status == EpisodeStatus.FINISHED]
            if finished:
                group = _Group(task_id, version,
                               RowBatch.concat(o.rows for o in finished if o.rows is not None),
                               kind=self._kind(data))
            ran = True
        except Exception as e:  # a bug above the episodes (merging): drop the group
            log.exception("group %s failed", task_id)
            self._errors.append(f"group {task_id}: {type(e).__name__}: {e}")
            ran = True
        finally:
            if not ran:
                self._cancelled.add(seq)
            self._running_episodes -= members - ended  # members never reported
            self._running.pop(seq, None)
            if self._oversample:
                self._ended[seq] = group
                while self._cursor in self._ended:  # settle in admission order
                    self._settle(self._cursor, self._ended.pop(self._cursor))
                    self._cursor += 1
                self._cancel_hopeless()
            else:
                self._settle(seq, group)
            self._poke()
            self._notify()

    def _settle(self, seq: int, group: _Group | None) -> None:
        """Batch, set aside, drop or discard an ended group; its staleness slot follows."""
        if group is not None:
            self._hold_against_record(group)
        accepted = False
        if seq in self._cancelled:
            self._cancelled.discard(seq)
            self._groups_discarded += not self._closed
        elif group is None:
            self._groups_dropped += 1
        elif group.baseline is None and self._set_aside(group.rows):
            self._groups_set_aside += 1
            self._set_aside_since_batch += 1
        elif self._oversample and self._past_bound(group.admitted_version):
            self._groups_discarded += 1
        else:
            self._ready.append(group)
            accepted = True
            self._groups_baselined += group.baseline is not None
            self._dump(group)
        self._gate.finish(accepted)

    def _kind(self, data: dict[str, Any]) -> str | None:
        key = self.config.baseline_by
        if key is None or self.config.is_eval:
            return None
        return json.dumps(data[key], sort_keys=True)

    def _hold_against_record(self, group: _Group) -> None:
        """`baseline_by`: set the baseline a uniform group trains against (if its kind's record
        is long enough and far enough from its reward), then add its rewards to the record."""
        if group.kind is None:
            return
        cfg = self.config
        rewards = _episode_rewards(group.rows)
        history = self._history.setdefault(group.kind, deque(maxlen=cfg.baseline_window))
        if (len(history) * 2 >= cfg.baseline_window and uniform_group(group.rows)
                and abs(rewards[0] - (mean := sum(history) / len(history)))
                >= cfg.baseline_min_gap):
            group.baseline = mean
        history.extend(rewards)

    def _past_bound(self, admitted_version: int) -> bool:
        """One more accepted group, admitted at this version, would be trained too stale."""
        return self._gate.accepted >= self._gate.limit(admitted_version)

    def _cancel_hopeless(self) -> None:
        """Cancel running groups that could only be discarded (the engine has better work)."""
        for seq, running in list(self._running.items()):
            if (running.started and seq not in self._cancelled
                    and self._past_bound(running.admitted_version)):
                self._cancelled.add(seq)
                running.task.cancel()

    def _may_grow(self, outcomes: list[EpisodeOutcome]) -> bool:
        """A group runs another round of members while its finished episodes all got one reward
        and `grow_uniform_groups` leaves rounds (never in eval)."""
        cfg = self.config
        rounds_run = len(outcomes) // cfg.group_size - 1
        return (rounds_run < cfg.grow_uniform_groups and not cfg.is_eval and not self._closed
                and _has_signal(outcomes) is False)

    async def _room_to_grow(self) -> None:
        """Wait until `group_size` more episodes fit under `max_concurrent_rollouts`. The feeder
        admits no new group meanwhile, so running episodes can only end: the wait ends within
        an episode timeout."""
        assert self._freed is not None
        cap, g = self.config.max_concurrent_rollouts, self.config.group_size
        self._growths_waiting += 1
        try:
            while self._running_episodes + g > cap:  # bounded: see the docstring
                self._freed.clear()
                await self._freed.wait()
        finally:
            self._growths_waiting -= 1
            self._poke()

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
        if self._freed is not None:
            self._freed.set()
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
        baselines = {group_id: g.baseline for g in groups if g.baseline is not None
                     for group_id in set(g.rows.group_ids)}
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
            baselines=baselines,
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
            groups_set_aside=self._groups_set_aside, groups_discarded=self._groups_discarded,
            groups_baselined=self._groups_baselined, groups_grown=self._groups_grown,
            grown_groups_with_signal=self._grown_with_signal,
            groups_queued=len(self._ready), rows_out=self._rows_out,
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

