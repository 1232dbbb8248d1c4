"""The trainer runs on whatever a launcher hands it (`relayrl.train.ports`), and the typed rows it
gets keep what the trainer needs: `advantage_source: turn` trains end to end."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from relayrl.config import RelayConfig
from relayrl.errors import ConfigError, InvalidRequest
from relayrl.rollout import RolloutConfig, RolloutController
from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig
from relayrl.train.packing import TrainBatch
from relayrl.train.trainer import PPOTrainer, merge_minibatches
from relayrl.trajectory import TrajectoryRow
from relayrl.trajectory.batch import RowBatch
from relayrl.workflow import RolloutWorkflow, rows_from_tensor_dict
from relayrl.workflow import workflow_context as wc
from tests.workflow.helpers import make_td


def _two_turn_row(session: str, turn_rewards: list[float], seed: int) -> TrajectoryRow:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 1000, (20,), generator=g).tolist()
    mask = [0] * 6 + [1] * 4 + [0] * 5 + [1] * 5  # prompt, turn 1, tool result, turn 2
    return TrajectoryRow(
        session_id=session, task_id="task", segment_id=f"{session}/seg", style="concat",
        interaction_ids=[f"{session}/c1", f"{session}/c2"], input_ids=ids, loss_mask=mask,
        logprobs=[-2.0 if m else 0.0 for m in mask],
        versions=[0 if m else -1 for m in mask], reward=turn_rewards[-1],
        turn_spans=[(6, 10), (15, 20)], turn_rewards=turn_rewards)


class TwoTurnWorkflow(RolloutWorkflow):
    """Episode 0 of a group earns its reward on the first turn, episode 1 earns nothing."""

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, TrajectoryRow]:
        ctx = wc.get()
        rewards = [1.0, 0.5] if ctx.sample_index == 0 else [0.0, 0.0]
        row = _two_turn_row(ctx.episode_id, rewards, seed=ctx.sample_index)
        return {row.interaction_ids[-1]: row}


@dataclass
class RecordingEngine:
    """A weight sink that remembers which versions it was given."""

    versions: list[int] = field(default_factory=list)

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        assert weights  # the trainer pushes real tensors
        self.versions.append(version)


@dataclass
class InProcessServices:
    """Services with no gateway: the workflow makes rows itself."""

    engine: RecordingEngine = field(default_factory=RecordingEngine)
    closed: bool = False
    rollouts: list[RolloutConfig] = field(default_factory=list)

    def batches(self, workflow: Any, workflow_kwargs: dict[str, Any] | None,
                dataset: Sequence[dict[str, Any]], rollout: RolloutConfig,
                version_fn: Callable[[], int]) -> RolloutController:
        self.rollouts.append(rollout)
        return RolloutController(workflow, dataset, rollout, version_fn=version_fn)

    async def aclose(self) -> None:
        self.closed = True


def _tiny_run(tmp_path: Path, model: str, trial: str, *, seed: int = 3, total_steps: int = 1,
              train: dict[str, Any] | None = None, **rollout: Any) -> RelayConfig:
    """A run of `total_steps` steps, one group of two per batch, fp32, checkpoint at the end."""
    return RelayConfig(
        model=model, fileroot=str(tmp_path), experiment_name="ports", trial_name=trial,
        seed=seed, train=TrainConfig(total_steps=total_steps, lr=1e-4, bf16=False,
                                     checkpoint_every=0, save_optimizer=False, **(train or {})),
        rollout=RolloutConfig(**{"group_size": 2, "batch_size": 1, "progress": False,
                                 "episode_timeout_s": 30.0, **rollout}))


def _handing(services: InProcessServices) -> Callable[[Any], Any]:
    """A launcher that hands the trainer `services`."""

    async def launcher(actor: Any) -> InProcessServices:
        return services

    return launcher


@pytest.mark.slow
def test_turn_advantages_train_through_the_trainer_on_a_launcher_it_was_handed(
        tmp_path: Path, tiny_llama_dir: str) -> None:
    cfg = _tiny_run(tmp_path, tiny_llama_dir, "t", seed=7, total_steps=2,
                    train={"advantage_source": "turn"}, max_concurrent_rollouts=4)
    services = InProcessServices()
    result = PPOTrainer(cfg, [{"q": 1}, {"q": 2}],
                        launcher=_handing(services)).train(TwoTurnWorkflow())
    assert result.steps == 2
    assert services.engine.versions == [1, 2]  # one push per step, stamped with the new version
    assert services.closed
    assert [r.seed for r in services.rollouts] == [7]  # the run's seed orders the data
    metrics = (cfg.log_dir / "metrics.jsonl").read_text()
    assert '"loss"' in metrics and '"trained_tokens"' in metrics


@pytest.mark.slow
def test_minibatches_take_an_optimizer_step_each_and_the_batch_one_version(
        tmp_path: Path, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _tiny_run(tmp_path, tiny_llama_dir, "mb", total_steps=2, train={"minibatches": 2},
                    batch_size=2)
    applied: list[int] = []
    apply = Actor.apply_gradients
    monkeypatch.setattr(Actor, "apply_gradients",
                        lambda self, lr: (applied.append(self.version), apply(self, lr)))
    proximal: list[torch.Tensor | None] = []
    update = Actor.update
    monkeypatch.setattr(Actor, "update", lambda self, batch, adv, prox=None, *a, **k: (
        proximal.append(prox), update(self, batch, adv, prox, *a, **k))[1])
    services = InProcessServices()
    result = PPOTrainer(cfg, [{"q": 1}, {"q": 2}],
                        launcher=_handing(services)).train(TwoTurnWorkflow())
    assert result.steps == 2
    # two groups of two a batch, every row trains: two optimizer steps of two rows each, the
    # version moving once a batch, and the engine sent each batch's final weights
    assert applied == [0, 0, 1, 1]
    assert services.engine.versions == [1, 2]
    assert all(p is not None and p.shape[0] == 2 for p in proximal)  # the batch-start policy
    steps = [json.loads(line) for line in (cfg.log_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "loss" in m]
    assert [m["step"] for m in trained] == [1, 2]
    assert all(m["minibatches"] == 2 and m["n_tokens"] == 4 * 9 for m in trained)
    # the second minibatch is scored against the weights before the first: its ratios moved
    assert all(abs(m["ratio_mean"] - 1.0) > 1e-7 for m in trained)


def test_a_step_of_minibatches_reports_mean_losses_and_summed_counts_and_times() -> None:
    parts = [{"n_tokens": 30.0, "loss": 0.2, "ratio_mean": 1.0, "update_s": 2.0,
              "forward_tokens": 100.0, "grad_norm": 1.0},
             {"n_tokens": 10.0, "loss": 0.6, "ratio_mean": 1.2, "update_s": 3.0,
              "forward_tokens": 50.0, "grad_norm": 3.0, "step": 4.0}]
    out = merge_minibatches(parts)
    assert out["loss"] == pytest.approx(0.4)  # the mean of the two steps' losses
    assert out["n_tokens"] == 40 and out["update_s"] == 5 and out["forward_tokens"] == 150
    assert out["tokens_per_s"] == pytest.approx(30.0)
    assert out["ratio_mean"] == pytest.approx(1.05)  # token-weighted
    assert out["step"] == 4 and out["minibatches"] == 2


class SlowEvalWorkflow(TwoTurnWorkflow):
    """TwoTurnWorkflow whose eval episodes take a while; logs when each episode starts and ends."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int, float]] = []

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, TrajectoryRow]:
        ctx = wc.get()
        kind = "eval" if ctx.is_eval else "rl"
        self.log.append((kind, "start", ctx.version, time.monotonic()))
        if ctx.is_eval:
            await asyncio.sleep(0.2)
        out = await super().arun_episode(engine, data)
        self.log.append((kind, "end", ctx.version, time.monotonic()))
        return out


@dataclass
class TimedEngine(RecordingEngine):
    """A weight sink that also remembers when each version arrived."""

    times: list[float] = field(default_factory=list)

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        await super().update_weights(weights, version)
        self.times.append(time.monotonic())


@pytest.mark.slow
def test_the_first_rollouts_sample_beside_the_eval_before_rl_and_no_update_overtakes_it(
        tmp_path: Path, tiny_llama_dir: str) -> None:
    cfg = _tiny_run(tmp_path, tiny_llama_dir, "e", max_concurrent_rollouts=8)
    services = InProcessServices(engine=TimedEngine())
    workflow = SlowEvalWorkflow()
    held_out = [{"q": i} for i in range(4)]
    result = PPOTrainer(cfg, [{"q": 1}, {"q": 2}], held_out,
                        launcher=_handing(services)).train(workflow)
    assert result.steps == 1 and result.eval_before is not None
    evals = [e for e in workflow.log if e[0] == "eval"]
    before_end = max(t for kind, edge, _, t in evals[: 2 * len(held_out)] if edge == "end")
    rl_starts = [t for kind, edge, _, t in workflow.log if kind == "rl" and edge == "start"]
    assert min(rl_starts) < before_end  # rollouts began while the eval still ran
    assert all(v == 0 for kind, _, v, t in evals if t <= before_end)  # scored at version 0
    assert isinstance(services.engine, TimedEngine)
    assert services.engine.times[0] > before_end  # the first update waited for the eval


@pytest.mark.slow
def test_held_out_episodes_run_as_many_at_once_as_eval_max_concurrent_says(
        tmp_path: Path, tiny_llama_dir: str) -> None:
    from relayrl.train.config import EvalConfig

    cfg = replace(_tiny_run(tmp_path, tiny_llama_dir, "c", max_concurrent_rollouts=2),
                  eval=EvalConfig(max_concurrent=5))
    services = InProcessServices()
    workflow = SlowEvalWorkflow()
    held_out = [{"q": i} for i in range(7)]
    PPOTrainer(cfg, [{"q": 1}, {"q": 2}], held_out, launcher=_handing(services)).train(workflow)
    assert sorted(r.max_concurrent_rollouts for r in services.rollouts) == [2, 5, 5]
    running, most = 0, 0
    for _kind, edge, _, _ in sorted((e for e in workflow.log if e[0] == "eval"),
                                   key=lambda e: e[3]):
        running += 1 if edge == "start" else -1
        most = max(most, running)
    assert most == 5  # not the 2 of the RL rollouts, not all 7


@dataclass
class KwargsRecordingServices(InProcessServices):
    """InProcessServices that also remember each controller's workflow kwargs and item count."""

    calls: list[tuple[dict[str, Any] | None, int]] = field(default_factory=list)

    def batches(self, workflow: Any, workflow_kwargs: dict[str, Any] | None,
                dataset: Sequence[dict[str, Any]], rollout: RolloutConfig,
                version_fn: Callable[[], int]) -> RolloutController:
        self.calls.append((workflow_kwargs, len(dataset)))
        return super().batches(workflow, workflow_kwargs, dataset, rollout, version_fn)


@pytest.mark.slow
def test_eval_sampled_runs_each_item_n_times_at_the_training_settings_before_and_after_rl(
        tmp_path: Path, tiny_llama_dir: str) -> None:
    from relayrl.train.config import EvalConfig

    cfg = replace(_tiny_run(tmp_path, tiny_llama_dir, "s"), eval=EvalConfig(sampled=3))
    services = KwargsRecordingServices()
    held_out = [{"q": i} for i in range(4)]
    train, greedy = {"temperature": 1.0}, {"temperature": 0.0}
    result = PPOTrainer(cfg, [{"q": 1}, {"q": 2}], held_out,
                        launcher=_handing(services)).train(TwoTurnWorkflow(), train, greedy)
    evals = [c for c in services.calls if c[1] != 2]  # the RL rollouts hold the 2 train items
    assert evals == [(greedy, 4), (train, 12), (greedy, 4), (train, 12)]
    for sampled in (result.eval_before_sampled, result.eval_after_sampled):
        assert sampled is not None and sampled.episodes == 12
        assert sampled.mean_reward == pytest.approx(0.5)  # an eval episode's last turn reward
    assert "(sampled 0.500 -> 0.500)" in result.summary()
    final = json.loads((cfg.log_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["eval_reward_before_sampled"] == pytest.approx(0.5)
    assert "eval_reward_after_sampled_se" in final

    plain = replace(cfg, trial_name="plain", eval=EvalConfig())
    quiet = KwargsRecordingServices()
    result = PPOTrainer(plain, [{"q": 1}, {"q": 2}], held_out,
                        launcher=_handing(quiet)).train(TwoTurnWorkflow(), train, greedy)
    assert result.eval_before_sampled is None and result.eval_after_sampled is None
    assert [c for c in quiet.calls if c[1] != 2] == [(greedy, 4), (greedy, 4)]
    assert "(sampled" not in result.summary()


def test_rows_from_a_tensor_dict_keep_turns_and_name_missing_fields() -> None:
    td = make_td(1, 8, reward=2.0, prompt_len=2)
    td["loss_mask"][0, 4:6] = 0  # two turns: [2, 4) and [6, 8)
    (row,) = rows_from_tensor_dict(td, "ep")
    assert row.turn_spans == [(2, 4), (6, 8)] and row.turn_rewards == [2.0, 2.0]
    assert row.session_id == "ep" and "missing" not in row.metadata
    del td["logprobs"]
    (bare,) = rows_from_tensor_dict(td, "ep")
    assert bare.metadata["missing"] == ["logprobs"]
    with pytest.raises(InvalidRequest, match="logprobs"):
        TrainBatch.from_rows([bare])


def test_a_row_batch_becomes_a_train_batch_with_its_labels_and_turn_spans() -> None:
    rows = RowBatch.concat([RowBatch.of_episode([_two_turn_row("a", [1.0, 0.5], 0)], "ea", "g"),
                            RowBatch.of_episode([_two_turn_row("b", [0.0, 0.0], 1)], "eb", "g")])
    tb = TrainBatch.from_row_batch(rows)
    assert tb.episode_ids == ("ea", "eb") and tb.group_ids == ("g", "g")
    assert tb.turn_spans == (((6, 10), (15, 20)), ((6, 10), (15, 20)))
    assert tb.turn_rewards == ((1.0, 0.5), (0.0, 0.0))
    assert tb.num_trained_tokens == 18


@pytest.mark.slow
async def test_the_in_process_launcher_keeps_one_staleness_rule_and_dumps_text(
        tiny_llama_dir: str, tmp_path: Path) -> None:
    import json

    from relayrl.gateway.config import GatewayConfig
    from relayrl.launch import LocalLauncher
    from relayrl.train.actor import Actor

    # a gateway rule of 1 x 1 would refuse the controller's own episodes from the third on
    cfg = RelayConfig(model=tiny_llama_dir, experiment_name="exp", trial_name="run3",
                      gateway=GatewayConfig(max_staleness=1, batch_size=1))
    services = await LocalLauncher(cfg)(Actor(tiny_llama_dir, TrainConfig(bf16=False)))
    try:
        assert services.gateway.deps.config.max_staleness is None
        for _ in range(5):
            await services.client.start_session()
        rollout = RolloutConfig(group_size=2, batch_size=1, progress=False,
                                dump_root=str(tmp_path), epochs=1)
        async with services.batches(TwoTurnWorkflow(), None, [{"q": 1}], rollout,
                                    version_fn=lambda: 0) as source:
            await source.next_batch()
    finally:
        await services.aclose()
    (dump,) = (tmp_path / "exp" / "run3").glob("rollout/*/*.jsonl")  # the run's names
    record = json.loads(dump.read_text().splitlines()[0])
    assert isinstance(record["prompt"], str) and isinstance(record["completion"], str)


class FlakyEval(RolloutWorkflow):
    """Item "slow-once" aborts on its first try only; item "broken" always aborts."""

    def __init__(self) -> None:
        self.tries: dict[str, int] = {}

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, TrajectoryRow]:
        name = data["name"]
        self.tries[name] = self.tries.get(name, 0) + 1
        if name == "broken" or (name == "slow-once" and self.tries[name] == 1):
            raise TimeoutError("episode ran past its timeout")
        row = _two_turn_row(wc.get().episode_id, [data["r"], data["r"]], seed=1)
        return {row.interaction_ids[-1]: row}


async def test_an_eval_retries_aborted_items_once_and_never_scores_them_zero(tmp_path) -> None:
    from types import SimpleNamespace

    from relayrl.train.trainer import _Run

    cfg = RelayConfig(fileroot=str(tmp_path), rollout=RolloutConfig(progress=False))
    run = _Run(cfg, SimpleNamespace(version=0), InProcessServices())  # type: ignore[arg-type]
    wf = FlakyEval()
    items = [{"name": "ok", "r": 1.0}, {"name": "slow-once", "r": 1.0},
             {"name": "broken", "r": 0.0}, {"name": "zero", "r": 0.0}]
    result = await run.evaluate(wf, None, items, "test")
    assert result is not None
    assert (result.episodes, result.aborted, result.excluded) == (3, 2, 1)
    assert result.mean_reward == pytest.approx(2 / 3)  # "broken" is left out, not a 0
    assert wf.tries == {"ok": 1, "slow-once": 2, "broken": 2, "zero": 1}


async def test_eval_dumps_keep_each_items_first_episode_and_can_be_turned_off(
        tmp_path) -> None:
    from types import SimpleNamespace

    from relayrl.train.trainer import _Run

    cfg = RelayConfig(fileroot=str(tmp_path),
                      rollout=RolloutConfig(progress=False, dump_root=str(tmp_path / "d")))
    run = _Run(cfg, SimpleNamespace(version=0), InProcessServices())  # type: ignore[arg-type]
    items = [{"name": "ok", "r": 0.25}, {"name": "slow-once", "r": 0.75}]
    await run.evaluate(FlakyEval(), None, items, "base", dump=False)
    dumps = tmp_path / "d" / "default" / "trial0" / "eval-rollout" / "0"
    assert not dumps.exists()
    result = await run.evaluate(FlakyEval(), None, items, "before RL")
    assert result is not None and result.episodes == 2
    # the retry of "slow-once" counts its own items: its task 0 must not replace item 0's file
    assert sorted(p.name for p in dumps.iterdir()) == ["0.jsonl"]
    (record,) = [json.loads(line) for line in (dumps / "0.jsonl").read_text().splitlines()]
    assert record["reward"] == 0.25


class CountingWorkflow(TwoTurnWorkflow):
    """TwoTurnWorkflow that counts the training episodes it was asked to run."""

    def __init__(self) -> None:
        self.rl_episodes = 0

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, TrajectoryRow]:
        self.rl_episodes += not wc.get().is_eval
        return await super().arun_episode(engine, data)


@pytest.mark.slow
def test_no_episode_runs_for_a_batch_that_no_step_will_take(
        tmp_path: Path, tiny_llama_dir: str) -> None:
    # staleness 4 would let five groups run ahead; two steps take two batches of one group
    cfg = _tiny_run(tmp_path, tiny_llama_dir, "n", total_steps=2, max_concurrent_rollouts=8,
                    max_staleness=4)
    workflow = CountingWorkflow()
    result = PPOTrainer(cfg, [{"q": i} for i in range(8)],
                        launcher=_handing(InProcessServices())).train(workflow)
    assert result.steps == 2
    assert workflow.rl_episodes == 4  # two groups of two, nothing sampled to be thrown away


class KindWorkflow(RolloutWorkflow):
    """Every episode of an item earns `data["reward"]`: each group is uniform."""

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, TrajectoryRow]:
        ctx = wc.get()
        r = float(data["reward"])
        row = _two_turn_row(ctx.episode_id, [r, r], seed=ctx.sample_index)
        return {row.interaction_ids[-1]: row}


def test_an_sft_replay_without_warm_up_traces_is_refused_before_the_run_starts(
        tmp_path: Path, tiny_llama_dir: str) -> None:
    cfg = _tiny_run(tmp_path, tiny_llama_dir, "r", train={"sft_replay_coef": 0.5})
    services = InProcessServices()
    with pytest.raises(ConfigError, match=r"sft_replay_coef > 0 needs warm-up traces"):
        PPOTrainer(cfg, [{"q": 1}], launcher=_handing(services)).train(TwoTurnWorkflow())
    assert services.engine.versions == [] and not cfg.log_dir.exists()


@pytest.mark.slow
def test_a_step_with_a_non_finite_gradient_is_skipped_and_the_run_goes_on(
        tmp_path: Path, tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _tiny_run(tmp_path, tiny_llama_dir, "nan", total_steps=2, max_staleness=0)
    norms = iter([math.inf])
    clip = Actor.clip_gradients
    monkeypatch.setattr(Actor, "clip_gradients",
                        lambda self: next(norms, None) or clip(self))
    services = InProcessServices()
    result = PPOTrainer(cfg, [{"q": 1}, {"q": 2}],
                        launcher=_handing(services)).train(TwoTurnWorkflow())
    # the bad batch moved no weight and took no step; the version still moved on (the staleness
    # rule admits rollouts by version: without it no batch would come), and two steps followed
    assert result.steps == 2
    assert services.engine.versions == [1, 2, 3]
    assert "non-finite gradient norm" in capsys.readouterr().out
    steps = [json.loads(line) for line in (cfg.log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "loss" in m] == [1, 2]
