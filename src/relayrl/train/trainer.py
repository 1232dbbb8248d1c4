"""`PPOTrainer`: the training loop. The trainer takes batches of whole groups from a batch
source, updates the policy, and pushes the new weights into the engine between decode steps.
What serves the policy (engine, gateway, the agents' sessions) is started by a `Launcher` from
`relayrl.launch` and reached only through the protocols in `relayrl.train.ports`.

One step: `controller.next_batch()` → `compute_advantages` → `actor.update` (in a worker thread,
so rollouts for the next batch keep sampling: asynchronous, bounded by `max_staleness`) →
`engine.update_weights` → log. The RL rollouts start as the held-out eval before RL does, with
the same weights, so the first batch is sampled while the eval runs. Everything else here is
set-up and tear-down.

Imports: train, rollout (records and config), trajectory, models, kernels (the core count).
Never engine, gateway or client: those belong to the launcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from relayrl.errors import ConfigError
from relayrl.kernels import usable_cores
from relayrl.models import model_path
from relayrl.rollout import Batch, RolloutController
from relayrl.train.actor import Actor
from relayrl.train.advantages import compute_advantages
from relayrl.train.checkpoint import latest_checkpoint
from relayrl.train.distributed import DistributedActor, join_process_group
from relayrl.train.losses import SUM_STATS, merge_stats
from relayrl.train.metrics import MetricsLogger, episode_metrics, role_metrics, trained_tokens
from relayrl.train.packing import TrainBatch, minibatch_rows
from relayrl.train.ports import (
    BatchSource,
    Launcher,
    Services,
    ThreadedEngine,
    TrainerSettings,
    engine_busy,
    engine_threads,
)
from relayrl.train.sft import run_sft
from relayrl.trajectory.atif import read_sft_rows
from relayrl.trajectory.batch import RowBatch

WORKFLOW_PREFIX = "workflow/"
"""Step metrics from the workflow's own counters (`RolloutWorkflow.counters`) carry this prefix."""


@dataclass(frozen=True)
class EvalResult:
    """Held-out evaluation: mean episode reward over the items that were scored."""

    mean_reward: float
    episodes: int
    """Items scored (the mean is over these)."""
    aborted: int
    """Items whose first episode aborted (each was run once more)."""
    excluded: int = 0
    """Items whose episode aborted twice: left out of the mean, never counted as 0."""
    stderr: float = 0.0
    """Standard error of the mean over the scored items (sample std / sqrt(n))."""
    tool_call_rate: float | None = None
    """Calls with at least one tool call, over the episodes' calls (None: no calls recorded)."""


@dataclass(frozen=True)
class TrainResult:
    """What a run produced."""

    steps: int
    checkpoint: Path | None
    eval_base: EvalResult | None
    """Held-out reward of the model as loaded (before any warm-start or RL)."""
    eval_before: EvalResult | None
    """Held-out reward before RL (after the SFT warm-start, if any)."""
    eval_after: EvalResult | None
    plot: Path | None
    metrics_path: Path
    wall_s: float
    workflow_counters: dict[str, float] = field(default_factory=dict)
    """The training workflow's cumulative counters at the last step (e.g. mask checks)."""
    eval_before_sampled: EvalResult | None = None
    """Held-out reward before RL over `eval.sampled` episodes per item at the training settings."""
    eval_after_sampled: EvalResult | None = None
    """The same after RL."""

    def summary(self) -> str:
        """One line: what improved, in how long, and where the results are."""
        def r(e: EvalResult | None) -> str:
            return "n/a" if e is None else f"{e.mean_reward:.3f}"

        def t(e: EvalResult | None) -> str:
            return "n/a" if e is None or e.tool_call_rate is None else f"{e.tool_call_rate:.3f}"

        base = f"base {r(self.eval_base)} -> " if self.eval_base is not None else ""
        counters = (f"; workflow {_counters_text(self.workflow_counters)}"
                    if self.workflow_counters else "")
        sampled = (f" (sampled {r(self.eval_before_sampled)} -> {r(self.eval_after_sampled)})"
                   if self.eval_before_sampled or self.eval_after_sampled else "")
        return (f"relayrl: held-out reward {base}before RL {r(self.eval_before)} -> after RL "
                f"{r(self.eval_after)}{sampled}, tool-call rate {t(self.eval_before)} -> "
                f"{t(self.eval_after)}, in {self.steps} steps, {self.wall_s / 60:.1f} min; "
                f"checkpoint {self.checkpoint}; plot {self.plot}{counters}")


def load_dataset(path: str | Path) -> list[dict[str, Any]]:
    """A JSONL (or Parquet) file of data items, e.g. `{"messages": [...], "answer": "35"}`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"dataset {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


class PPOTrainer:
    """Trains the policy on episodes of any agent (`trainer.train(workflow="my_agent.MathAgent")`).

    `launcher` starts what serves the policy; `relayrl.launch.LocalLauncher(config)` runs the
    engine and the gateway in this process. Scripts use `relayrl.PPOTrainer` (in
    `relayrl.launch.trainer`), which starts them itself.
    """

    def __init__(self, config: TrainerSettings, train_dataset: Sequence[dict[str, Any]],
                 eval_dataset: Sequence[dict[str, Any]] | None = None, *,
                 launcher: Launcher) -> None:
        self.config = config
        self.launcher = launcher
        self.train_dataset = list(train_dataset)
        limit = config.eval.max_items
        self.eval_dataset = list(eval_dataset)[:limit] if eval_dataset else None

    def train(self, workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
              eval_workflow_kwargs: dict[str, Any] | None = None) -> TrainResult:
        """Run the whole job: optional SFT warm-start, eval, RL steps, eval, checkpoint, plot."""
        return asyncio.run(self.atrain(workflow, workflow_kwargs, eval_workflow_kwargs))

    async def atrain(self, workflow: Any, workflow_kwargs: dict[str, Any] | None = None,
                     eval_workflow_kwargs: dict[str, Any] | None = None) -> TrainResult:
        """`train`, for callers already inside an event loop."""
        cfg = self.config
        started = time.perf_counter()
        if cfg.train.sft_replay_coef > 0 and not cfg.sft.data:
            raise ConfigError("train.sft_replay_coef > 0 needs warm-up traces (sft.data)")
        _seed_everything(cfg.seed)
        actor = self._make_actor()
        if isinstance(actor, DistributedActor):
            actor.sync_state()  # every rank starts from rank 0's weights, like DDP
            if not actor.is_leader:  # ranks 1..W-1 only take their part of rank 0's updates
                # a run's commands: one update per minibatch a step (and with several, one
                # scoring of the batch), batches without a step, the warm-start's weights, the
                # KL's reference, the stop (with room to spare)
                actor.follow(max_messages=(cfg.train.minibatches + 4) * cfg.train.total_steps + 4)
                return TrainResult(actor.step, None, None, None, None, None,
                                   cfg.log_dir / "metrics.jsonl", time.perf_counter() - started)
        fresh = actor.step == 0
        eval_kwargs = eval_workflow_kwargs or workflow_kwargs
        run = _Run(cfg, actor, await self.launcher(actor))
        base = before_sampled = after_sampled = None

        async def sampled(tag: str) -> EvalResult | None:
            # A greedy eval follows each item's one most likely path, so items alike pass or fail
            # together and the mean moves in large steps; sampled at the training settings it
            # follows the mean reward RL raises. No dumps: their task ids would replace the
            # greedy eval's files of the same version.
            n = cfg.eval.sampled
            if not n or not self.eval_dataset:
                return None
            items = [item for item in self.eval_dataset for _ in range(n)]
            return await run.evaluate(workflow, workflow_kwargs, items,
                                      f"{tag}, {n} samples a question at the training settings",
                                      dump=False)

        logger = MetricsLogger(cfg.log_dir)
        try:
            if fresh and cfg.sft.data:
                if cfg.eval.base:
                    # at version 0 like the eval before RL, whose dumps would replace its files
                    base = await run.evaluate(workflow, eval_kwargs, self.eval_dataset, "base",
                                              dump=False)
                await run.warm_start(read_sft_rows(cfg.sft.data, model_path(cfg.model)))
            async with run.rollouts(workflow, workflow_kwargs, self.train_dataset) as rollouts:
                # The first batches sample with the weights the eval scores, beside it: the
                # engine batches both, and the first update need not wait for its batch. No
                # update runs before the eval ends, so every eval token is of this version.
                start = getattr(rollouts, "start", None)
                if start is not None and actor.step < cfg.train.total_steps:
                    _want_batches(rollouts, cfg.train.total_steps - actor.step)
                    start()
                before = await run.evaluate(workflow, eval_kwargs, self.eval_dataset,
                                            "before RL")
                before_sampled = await sampled("before RL")
                before_step = actor.step
                await run.loop(rollouts, logger, evaluate=lambda: run.evaluate(
                    workflow, eval_kwargs, self.eval_dataset, f"at step {actor.step}"))
            # the final weights are written while the eval after RL scores them (the engine
            # holds its own copy; nothing updates the actor's weights any more)
            saving = asyncio.get_running_loop().run_in_executor(
                run.update_thread, actor.save_checkpoint, cfg.checkpoint_dir)
            after = await run.evaluate(workflow, eval_kwargs, self.eval_dataset, "after RL")
            after_sampled = await sampled("after RL")
            checkpoint = await saving
        finally:
            run.update_thread.shutdown(wait=False)
            await run.services.aclose()
        if isinstance(actor, DistributedActor):
            actor.stop_followers()  # (on an error the launcher stops them instead)
        evals = {"eval_reward_base": base, "eval_reward_before": before, "eval_reward_after": after,
                 "eval_reward_before_sampled": before_sampled,
                 "eval_reward_after_sampled": after_sampled}
        final = {"eval_before_step": before_step,
                 **{k: v.mean_reward for k, v in evals.items() if v is not None},
                 **_eval_extras(evals)}
        every = cfg.eval.every
        if (after is not None and every and actor.step % every == 0
                and actor.step >= cfg.train.total_steps):
            final.update(_eval_metrics(after))  # the periodic eval of the last step (see loop)
        logger.log(actor.step, final)
        plot = logger.plot(cfg.log_dir / "reward_loss.png")
        logger.close()
        return TrainResult(actor.step, checkpoint, base, before, after, plot,
                           cfg.log_dir / "metrics.jsonl", time.perf_counter() - started,
                           dict(run.workflow_counters), before_sampled, after_sampled)

    def _make_actor(self) -> Actor:
        cfg = self.config
        cls, device = Actor, _device()
        if cfg.train.world_size > 1:
            cls, device = DistributedActor, str(join_process_group(cfg.train.world_size))
        last = latest_checkpoint(cfg.checkpoint_dir)
        if last is not None:  # the KL reference is the original model
            return cls.resume(last, cfg.train, device=device,
                              reference_path=model_path(cfg.model))
        return cls(model_path(cfg.model), cfg.train, device=device)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _in_threads(threads: int, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` with `threads` torch threads in this (worker) thread.

    OpenMP's thread count is per thread, and a thread started after another one set it (the
    engine sets 1 for its own) starts with that count: without this, the update thread ran every
    update on one thread whatever the machine had.
    """
    torch.set_num_threads(threads)
    return fn(*args)


def _update_thread() -> ThreadPoolExecutor:
    """The one thread every SFT and RL update of a run runs on.

    glibc serves each thread from its own heap arena and keeps freed blocks there: with
    `asyncio.to_thread`'s pool an update ran on whichever worker was free, and every worker's
    arena could keep an update's worth of freed activations. One thread reuses one arena, and
    its OpenMP team is made once.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="relayrl-update")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class _Lent:
    """How long an update ran on an idle engine's cores too."""

    seconds: float = 0.0
    since: float | None = None
    """When the current lending began (None: not lending now)."""

    def toggle(self, now: float) -> None:
        """Start lending, or stop and count the time."""
        if self.since is None:
            self.since = now
        else:
            self.seconds += now - self.since
            self.since = None


@dataclass
class _Run:
    """One training run's moving parts."""

    cfg: TrainerSettings
    actor: Actor
    services: Services
    workflow_counters: dict[str, float] = field(default_factory=dict)
    """The training controller's workflow counters as of the last batch."""
    update_thread: ThreadPoolExecutor = field(default_factory=_update_thread)
    _replay_rows: list[Any] | None = None
    _replay_rng: random.Random | None = None

    async def off_loop(self, phase: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the update thread with the phase's torch threads; the loop runs on."""
        return await asyncio.get_running_loop().run_in_executor(
            self.update_thread, functools.partial(_in_threads, self.threads(phase), fn, *args))

    def threads(self, phase: str) -> int:
        """Torch threads for an SFT or RL update (`train.num_threads` unless None): every core
        for SFT, when no rollout runs; for RL, the cores left by an in-process engine, which
        samples the next batch while the update runs (more threads than cores slows both:
        benchmarks/RESULTS.md, "Engine threads under contention")."""
        if self.cfg.train.num_threads is not None:
            return self.cfg.train.num_threads
        cores = usable_cores()
        if phase == "sft":
            return cores
        return max(1, cores - engine_threads(self.services))

    def _controller(self, workflow: Any, kwargs: dict[str, Any] | None,
                    dataset: Sequence[dict[str, Any]], is_eval: bool,
                    dump: bool = True) -> BatchSource:
        rollout = self.cfg.rollout
        if rollout.seed is None:  # the run's seed orders the data too: seeds differ in it
            rollout = replace(rollout, seed=self.cfg.seed)
        if is_eval:
            rollout = replace(rollout, group_size=1, batch_size=len(dataset), epochs=1,
                              shuffle=False, is_eval=True,
                              max_staleness=0,
                              max_concurrent_rollouts=self.cfg.eval.max_concurrent
                              or rollout.max_concurrent_rollouts)
        if not dump:
            rollout = replace(rollout, dump_root=None)
        return self.services.batches(workflow, kwargs, dataset, rollout,
                                     version_fn=lambda: self.actor.version)

    async def warm_start(self, rows: Sequence[Any]) -> None:
        """SFT on recorded traces, then serve the warmed weights (the version stays 0)."""
        sft_log = MetricsLogger(self.cfg.log_dir / "sft", tensorboard=False)
        await self.off_loop("sft", run_sft, self.actor, rows, self.cfg.sft, self.cfg.seed,
                            sft_log.log)
        sft_log.close()
        if isinstance(self.actor, DistributedActor):
            self.actor.sync_followers()  # SFT ran on rank 0 alone
        await self.services.engine.update_weights(self.actor.state_dict_for_engine(),
                                                  version=self.actor.version)

    async def evaluate(self, workflow: Any, kwargs: dict[str, Any] | None,
                       dataset: Sequence[dict[str, Any]] | None, tag: str,
                       dump: bool = True) -> EvalResult | None:
        """Mean reward of one episode per eval item, over the items that were scored.

        `dump=False` writes no trajectory dumps (the config's `dump_root` aside).

        An episode that aborted (a timeout on a busy machine, an agent crash) says nothing about
        the policy's answer, so it is not a 0: its item is run once more, and if it aborts
        again it is excluded and counted next to the mean.
        """
        if not dataset:
            return None
        started = time.perf_counter()
        batches: list[RowBatch] = []
        with self._engine_takes_update_cores():
            scores = await self._eval_pass(workflow, kwargs, dataset, batches, dump=dump)
            missing = [i for i in range(len(dataset)) if i not in scores]
            if missing:
                # no dumps: the retry's task ids count the retried items, and its files would
                # replace the first pass's under the same ids
                again = await self._eval_pass(workflow, kwargs, [dataset[i] for i in missing],
                                              batches, dump=False)
                scores.update({missing[j]: r for j, r in again.items()})
        excluded = len(dataset) - len(scores)
        values = list(scores.values())
        mean = sum(values) / len(values) if values else 0.0
        stderr = (math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)
                            / len(values)) if len(values) > 1 else 0.0)
        tool_rate = (episode_metrics(RowBatch.concat(batches)).get("tool_call_rate")
                     if batches else None)
        result = EvalResult(mean, len(scores), len(missing), excluded, stderr, tool_rate)
        tools = "" if tool_rate is None else f", tool-call rate {tool_rate:.3f}"
        print(f"eval {tag}: mean reward {result.mean_reward:.3f} ± {stderr:.3f} over "
              f"{result.episodes} held-out episodes ({result.aborted} aborted and retried, "
              f"{result.excluded} excluded){tools}, {time.perf_counter() - started:.0f} s",
              flush=True)
        return result

    @contextlib.contextmanager
    def _engine_takes_update_cores(self) -> Iterator[None]:
        """An in-process engine runs on its threads plus the RL update's while no update runs
        (an eval, or the RL loop awaiting a batch, leaves the update thread idle)."""
        engine = self.services.engine
        own = int(engine.num_threads or 0) if isinstance(engine, ThreadedEngine) else 0
        if not isinstance(engine, ThreadedEngine) or own < 1:
            yield
            return
        engine.set_threads(own + self.threads("rl"))
        try:
            yield
        finally:
            engine.set_threads(None)

    @contextlib.asynccontextmanager
    async def _lend_idle_engine_cores(
            self, rollouts_running: Callable[[], int] | None) -> AsyncIterator[_Lent]:
        """While no rollout runs, the update computes on its threads plus the engine's.

        Under the staleness rule, once the next batch's episodes have all finished none starts
        again before this update's weights are pushed, so the engine stays idle for the rest of
        the update; the actor picks the count up at its next decoder layer. Checked every 50 ms
        on the loop (the update thread only reads an int).
        """
        lent = _Lent()
        extra = engine_threads(self.services)
        train = self.cfg.train
        if (rollouts_running is None or extra < 1 or train.num_threads is not None
                or not train.lend_engine_cores):
            yield lent
            return
        actor, threads = self.actor, self.threads("rl")
        engine = self.services.engine

        async def watch() -> None:
            while True:
                idle = rollouts_running() == 0 and not engine_busy(engine)
                if idle != (lent.since is not None):
                    lent.toggle(time.perf_counter())
                    actor.threads_wanted = threads + extra if idle else threads
                await asyncio.sleep(0.05)

        actor.threads_wanted = threads
        task = asyncio.create_task(watch())
        try:
            yield lent
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if lent.since is not None:
                lent.toggle(time.perf_counter())
            actor.threads_wanted = None

    async def _eval_pass(self, workflow: Any, kwargs: dict[str, Any] | None,
                         items: Sequence[dict[str, Any]], batches: list[RowBatch],
                         dump: bool) -> dict[int, float]:
        """Item index -> reward of its one episode (items whose episode left no rows: absent);
        `dump=False` writes no trajectory dumps even where the run's config asks for them."""
        scores: dict[int, float] = {}
        async with self._controller(workflow, kwargs, items, is_eval=True,
                                    dump=dump) as controller:
            with contextlib.suppress(StopAsyncIteration):
                for _ in range(len(items) + 1):  # bounded: one batch holds the whole set
                    s = controller.stats()
                    if s.groups_accepted + s.groups_dropped >= len(items) and not s.groups_queued:
                        break  # every item ran once (asking again would wait for more data)
                    batch = await controller.next_batch()
                    batches.append(batch.rows)
                    # unshuffled, one group per item: task ids count the items in order
                    for task, r in zip(batch.task_ids, batch.rows.rewards, strict=True):
                        scores[int(task)] = max(r, scores.get(int(task), float("-inf")))
        return scores

    def rollouts(self, workflow: Any, kwargs: dict[str, Any] | None,
                 dataset: Sequence[dict[str, Any]]) -> BatchSource:
        """The source of the RL loop's batches (enter it, then pass it to `loop`)."""
        return self._controller(workflow, kwargs, dataset, is_eval=False)

    async def loop(self, controller: BatchSource, logger: MetricsLogger,
                   evaluate: Callable[[], Awaitable[EvalResult | None]] | None = None) -> None:
        """RL steps on `controller`'s batches until `train.total_steps` (or the data runs out)."""
        cfg, actor = self.cfg, self.actor
        skipped = 0
        # bounded: batches without signal take no step, so allow a few of them per step
        for _ in range(4 * cfg.train.total_steps):
            if actor.step >= cfg.train.total_steps:
                break
            # no episode for a batch that no step will take (a skipped batch asks for one more)
            _want_batches(controller, cfg.train.total_steps - actor.step)
            try:
                # between updates: rollouts still running get the update's cores too
                with self._engine_takes_update_cores():
                    batch = await controller.next_batch()
            except StopAsyncIteration:
                break
            # only our own rollouts stop under the staleness rule; agents of a service may
            # call the engine at any time
            running = (lambda c=controller: c.stats().running) if isinstance(
                controller, RolloutController) else None
            metrics = await self.step(batch, running)
            self.workflow_counters = dict(batch.stats.workflow)
            if metrics.get("n_tokens", 0) == 0:
                skipped += 1
                counters = _counters_text(batch.stats.workflow)
                print(f"batch without signal (every group uniform, reward mean "
                      f"{metrics.get('reward_mean', 0):.2f}): no step"
                      f"{'; workflow ' + counters if counters else ''}", flush=True)
                continue
            if metrics.get("skipped_nonfinite") and "step" not in metrics:
                skipped += 1
                print(f"non-finite gradient norm ({metrics.get('grad_norm')}): the batch took "
                      "no step", flush=True)
                continue
            metrics["skipped_batches"] = float(skipped)
            every = cfg.eval.every
            # the last step's weights are scored once, by the eval after RL (logged as both)
            if (evaluate is not None and every and actor.step % every == 0
                    and actor.step < cfg.train.total_steps):
                result = await evaluate()
                if result is not None:
                    metrics.update(_eval_metrics(result))
            logger.log(actor.step, metrics)
            _print_step(actor.step, cfg.train.total_steps, metrics)
            every = cfg.train.checkpoint_every
            if every and actor.step % every == 0 and actor.step < cfg.train.total_steps:
                actor.save_checkpoint(cfg.checkpoint_dir)

    def replay_batch(self) -> TrainBatch | None:
        """`train.sft_replay_rows` warm-up traces for this step's SFT loss (None when it is off)."""
        train, sft = self.cfg.train, self.cfg.sft
        if train.sft_replay_coef <= 0:
            return None
        if self._replay_rows is None:
            if not sft.data:  # (PPOTrainer checks this before its run starts)
                raise ConfigError("train.sft_replay_coef > 0 needs warm-up traces (sft.data)")
            rows = read_sft_rows(sft.data, model_path(self.cfg.model))
            # the rows the warm-start imitated, so the replay anchors what it taught
            self._replay_rows = rows[: sft.max_rows] if sft.max_rows else rows
            self._replay_rng = random.Random(self.cfg.seed)
        assert self._replay_rng is not None
        picked = self._replay_rng.sample(self._replay_rows,
                                         min(train.sft_replay_rows, len(self._replay_rows)))
        return TrainBatch.from_rows(picked)

    def _update(self, batch: TrainBatch, adv_B_T: torch.Tensor) -> dict[str, float]:
        """The batch's optimizer steps (`update_in_minibatches`), each with a replay draw."""
        return update_in_minibatches(self.actor, batch, adv_B_T, self.cfg.train.minibatches,
                                     self.replay_batch)

    async def step(self, batch: Batch,
                   rollouts_running: Callable[[], int] | None = None) -> dict[str, float]:
        """One RL step on a batch: advantages, update (off the event loop), push weights.

        `rollouts_running` (episodes in flight) lets the update take an in-process engine's
        cores from the moment no rollout runs (see `_lend_idle_engine_cores`).
        """
        started = time.perf_counter()
        tb = TrainBatch.from_row_batch(batch.rows)
        adv = compute_advantages(tb, self.cfg.train)
        version = self.actor.version
        # rollouts keep sampling with the old weights while the update runs in a thread
        async with self._lend_idle_engine_cores(rollouts_running) as lent:
            metrics = await self.off_loop("rl", self._update, adv.batch, adv.adv_B_T)
        metrics["update_lent_cores_s"] = lent.seconds
        if self.actor.version == version:
            # No step (no signal: every group uniform; or a non-finite gradient norm), but the
            # version moves on, or the staleness rule (which admits by version) would never
            # admit another batch and the run would wait forever.
            self.actor.version += 1
        await self.services.engine.update_weights(self.actor.state_dict_for_engine(),
                                                  version=self.actor.version)
        stats = batch.stats
        step_s = time.perf_counter() - started
        metrics.update(
            adv.stats, rows=float(tb.num_rows),
            aborted_episodes=float(stats.aborted), rejected_episodes=float(stats.rejected),
            set_aside_groups=float(stats.groups_set_aside),
            step_s=step_s, trained_tokens_per_s=trained_tokens(batch.rows) / max(step_s, 1e-9),
        )
        metrics.update(episode_metrics(batch.rows))
        metrics.update(role_metrics(batch.rows))
        # cumulative, per reason: a spike in one reason (timeouts, a crashing tool) stands out
        metrics.update({f"aborted/{reason}": float(n)
                        for reason, n in stats.aborted_by_reason.items()})
        # cumulative, like the abort counts: what the workflow checked (a remote rollout
        # server's response_mask agreement, the rollouts it dropped or that failed)
        metrics.update({f"{WORKFLOW_PREFIX}{k}": float(v) for k, v in stats.workflow.items()})
        return metrics


def update_in_minibatches(actor: Actor, batch: TrainBatch, adv_B_T: torch.Tensor,
                          minibatches: int, replay: Callable[[], TrainBatch | None]
                          ) -> dict[str, float]:
    """A rollout batch's optimizer steps: one, or one per minibatch (`train.minibatches`).

    Minibatches are contiguous parts of the rows that train, each an optimizer step with its
    own `replay()` draw, all scored against the policy that started the batch (the proximal
    logprobs of decoupled PPO, computed once up front), so that after the first step the
    ratios move and the clip bites. `step` and `version` advance once, with the last
    minibatch: the engine is sent the batch's final weights.
    """
    live = batch.loss_mask_B_T.any(-1).nonzero()[:, 0].tolist()
    parts = minibatch_rows(len(live), minibatches)
    if len(parts) <= 1:
        return actor.update(batch, adv_B_T, replay=replay())
    prox_B_T = actor.proximal_logprobs(batch)
    results = []
    for i, part in enumerate(parts):  # bounded by minibatches
        index = torch.tensor([live[j] for j in part], dtype=torch.long)
        results.append(actor.update(
            batch.select(index.tolist()), adv_B_T[index], prox_B_T[index], replay=replay(),
            advance=i == len(parts) - 1))
    return merge_minibatches(results)


def merge_minibatches(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its minibatches' updates: counts and times add up, losses are
    the mean over the optimizer steps, the rest the token-weighted mean (`merge_stats`)."""
    stepped = [p for p in parts if p.get("n_tokens", 0) > 0]
    out = merge_stats(parts)
    for key in SUM_STATS - {"n_tokens"}:
        if key in out:
            out[key] /= max(len([p for p in stepped if key in p]), 1)
    for key in ("update_s", "forward_tokens", "skipped_nonfinite"):
        if any(key in p for p in parts):
            out[key] = sum(p.get(key, 0.0) for p in parts)
    if out.get("update_s"):
        out["tokens_per_s"] = out.get("forward_tokens", 0.0) / out["update_s"]
    steps = [p["step"] for p in parts if "step" in p]
    if steps:
        out["step"] = steps[-1]
    out["minibatches"] = float(len(parts))
    return out


def _want_batches(source: Any, remaining: int) -> None:
    """Tell a rollout controller how many more batches training will take (others: nothing)."""
    limit = getattr(source, "limit_batches", None)
    if limit is not None:
        limit(remaining)


def _eval_metrics(result: EvalResult) -> dict[str, float]:
    """A periodic held-out eval as step metrics."""
    out = {"eval_reward": result.mean_reward, "eval_reward_se": result.stderr}
    if result.tool_call_rate is not None:
        out["eval_tool_call_rate"] = result.tool_call_rate
    return out


def _eval_extras(evals: dict[str, EvalResult | None]) -> dict[str, float]:
    """Standard errors and tool-call rates of the final evaluations, keyed like their means."""
    out: dict[str, float] = {}
    for key, e in evals.items():
        if e is None:
            continue
        out[f"{key}_se"] = e.stderr
        if e.tool_call_rate is not None:
            out[key.replace("eval_reward", "eval_tool_call_rate")] = e.tool_call_rate
    return out


def _counters_text(counters: dict[str, float]) -> str:
    """`k=v ...` for the log line (counts print as integers)."""
    return " ".join(f"{k}={v:g}" for k, v in counters.items())


def _print_step(step: int, total: int, m: dict[str, float]) -> None:
    keys = ("reward_mean", "loss", "approx_kl", "clip_frac", "tool_call_rate",
            "trained_tokens_per_s", "step_s", "set_aside_groups")
    shown = " ".join(f"{k}={m[k]:.3g}" for k in keys  # group counts: 0 unless sampling adapts
                     if k in m and (m[k] or not k.endswith("_groups")))
    counters = _counters_text({k[len(WORKFLOW_PREFIX):]: v for k, v in m.items()
                               if k.startswith(WORKFLOW_PREFIX)})
    print(f"step {step}/{total} {shown}{' workflow ' + counters if counters else ''}",
          flush=True)
