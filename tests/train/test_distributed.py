"""Data-parallel training (`train.world_size`): two gloo ranks on 127.0.0.1 take the same step as
one process on the same batch (gradients, updated weights, loss), groups are never split, and
`relayrl train CONFIG train.world_size=2` runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relayrl.config import RelayConfig
from relayrl.errors import ConfigError
from relayrl.launch.run import train as run_train
from relayrl.train.actor import Actor
from relayrl.train.advantages import compute_advantages
from relayrl.train.config import TrainConfig
from relayrl.train.distributed import (
    join_process_group,
    rank_device,
    row_costs,
    shard_groups,
    shard_replay,
)
from relayrl.train.losses import token_weights
from relayrl.trajectory import TrajectoryRow, write_jsonl

from .conftest import random_batch
from .distributed_cases import Case, crash_on_rank0, one_step, rank_worker

GRAD_RTOL = 1e-5
"""Measured on this CPU (fp32, gloo): max |g2 - g1| is 4e-6 of max |g1| (micro-batches of other
shapes and another summation order); a wrong loss normalization would be off by a factor (2x
for a per-rank token mean over two ranks)."""
WEIGHT_MEAN_ATOL = 1e-8
"""Measured: after one AdamW step (lr 1e-3) the weights differ by 3e-10 on average."""
WEIGHT_MAX_STEPS = 0.1
"""The largest difference, in learning rates. AdamW's first step is lr * g / (|g| + eps), whose
slope at g = 0 is lr / eps (1e5 with eps 1e-8): gradients of ~1e-8 that differ by rounding move by
a few percent of a step. Measured: 0.043 lr, on 0.01% of the weights (all others under 1e-7)."""


# -- sharding (pure) ----------------------------------------------------------------------------

def test_groups_are_kept_whole_and_balanced_by_the_tokens_they_cost() -> None:
    groups = ["a", "a", "b", "b", "b", "c", "d"]
    costs = [10, 10, 5, 5, 5, 30, 0]
    shards = shard_groups(groups, costs, 2)
    assert sorted(i for s in shards for i in s) == list(range(7))  # every row exactly once
    for s in shards:
        for g in {groups[i] for i in s}:  # a group lives on one rank
            assert {i for i, x in enumerate(groups) if x == g} <= set(s)
    assert [sum(costs[i] for i in s) for s in shards] == [30, 35]  # c alone; a + b (+ d)
    assert shards == shard_groups(groups, costs, 2)  # deterministic: every run shards alike


def test_fewer_groups_than_ranks_leaves_a_rank_empty() -> None:
    assert shard_groups(["g", "g", "g"], [4, 5, 6], 2) == [[0, 1, 2], []]


def test_replay_rows_go_to_the_ranks_with_rl_tokens_least_loaded_first() -> None:
    # rank 0 carries 30 RL tokens, rank 1 10: the largest replay rows fill rank 1 up first
    assert shard_replay([12, 8, 5, 20], [30, 10]) == [[0], [1, 2, 3]]
    assert shard_replay([12, 8, 5, 20], [0, 10]) == [[], [0, 1, 2, 3]]  # rank 0 takes no step
    assert shard_replay([12, 8], [0, 0]) == [[], []]  # nobody does: no replay
    assert shard_replay([4, 4, 4, 4], [10, 10, 10]) == [[0, 3], [1], [2]]


def test_rows_without_trained_tokens_cost_nothing() -> None:
    batch = random_batch([6, 9, 4], vocab=50)
    batch = replace(batch, loss_mask_B_T=batch.loss_mask_B_T & (torch.arange(3) != 1)[:, None])
    assert row_costs(batch) == [6, 0, 4]


def test_per_rank_loss_shares_add_up_to_the_global_loss() -> None:
    batch = random_batch([12, 9, 15, 7, 11], vocab=50)
    for agg in ("token", "seq-mean-token-mean"):  # the means whose shares add up to 1
        global_ = token_weights(batch.loss_mask_B_T, agg)
        parts = shard_groups(["a", "a", "b", "b", "c"], row_costs(batch), 2)
        assert sum(float(global_[p].sum()) for p in parts) == pytest.approx(1.0)
        # what a per-rank normalization would give instead: not the same loss
        local = sum(float(token_weights(batch.loss_mask_B_T[p], agg).sum()) for p in parts)
        assert local == pytest.approx(2.0)


def test_world_size_is_checked() -> None:
    with pytest.raises(ConfigError, match="world_size"):
        TrainConfig(world_size=0)


def test_a_process_outside_a_launch_is_told_how_to_start_ranks(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="relayrl train"):
        join_process_group(2)


def test_a_rank_without_a_gpu_of_its_own_is_refused_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_device(0) == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="GPU of its own: LOCAL_RANK=1, but this machine has 1"):
        rank_device(1)
    started: list[int] = []
    monkeypatch.setattr("relayrl.launch.run.launch_workers", lambda n, *a, **k: started.append(n))
    cfg = RelayConfig(fileroot=str(tmp_path), train=TrainConfig(world_size=2))
    with pytest.raises(ConfigError, match=r"train\.world_size to at most 1"):
        run_train(cfg, [{"q": 0}], workflow="unused.Agent")
    assert not started


# -- two ranks against one process --------------------------------------------------------------

def _case(name: str, model_dir: str, lengths: list[int], groups: list[str],
          replay_lengths: list[int] | None = None, **train: object) -> Case:
    cfg = TrainConfig(bf16=False, lr=1e-3, checkpoint_every=0, **train)  # type: ignore[arg-type]
    batch = random_batch(lengths, vocab=49152, seed=len(lengths))
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(len(lengths), generator=g)
    batch = replace(batch, group_ids=tuple(groups), rewards_B=rewards)
    # behaviour logprobs near the model's own, so ratios and importance weights are ~1
    own = Actor(model_dir, cfg).compute_logprobs(batch)
    noise = 0.05 * torch.randn(own.shape, generator=g)
    batch = replace(batch, behav_logprobs_B_T=(own + noise) * batch.loss_mask_B_T)
    adv = compute_advantages(batch, cfg)
    replay = (None if replay_lengths is None
              else random_batch(replay_lengths, vocab=49152, seed=100 + len(replay_lengths)))
    return name, cfg, adv.batch, adv.adv_B_T, replay


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    scale = max(float(t.abs().max()) for t in b.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def _max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _mean_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    return float(diffs.mean())


@pytest.mark.slow
def test_two_ranks_take_the_same_step_as_one_process(tiny_llama_dir: str, tmp_path: Path) -> None:
    from relayrl.launch.distributed import launch_workers

    cases = [
        # 5 rows in groups of 2, 2, 1 (the lone one is dropped: no signal); small micro-batches
        _case("uneven", tiny_llama_dir, [12, 9, 15, 7, 11], ["a", "a", "b", "b", "c"],
              micro_batch_tokens=24),
        # 7 rows in groups of 3, 2, 2; every row weighs the same, whatever its length
        _case("seq-mean", tiny_llama_dir, [10, 14, 8, 13, 9, 12, 6],
              ["a", "a", "a", "b", "b", "c", "c"], loss_agg="seq-mean-token-mean"),
        # one group for two ranks: rank 1 has nothing to train and adds zeros
        _case("one-group", tiny_llama_dir, [10, 13, 8], ["a", "a", "a"]),
        # an SFT replay of 3 rows shared between the ranks (PPO-ptx): its loss is the mean
        # NLL over all its trained tokens, as in one process
        _case("replay", tiny_llama_dir, [12, 9, 15, 7], ["a", "a", "b", "b"],
              replay_lengths=[14, 8, 11], sft_replay_coef=0.5, micro_batch_tokens=40),
        # the replay with one group: rank 1 has no RL tokens, so every replay row runs on rank 0
        _case("one-group-replay", tiny_llama_dir, [10, 13, 8], ["a", "a", "a"],
              replay_lengths=[9, 12], sft_replay_coef=0.5),
        # two optimizer steps on halves of the rows, the second against the batch-start logprobs
        _case("minibatches", tiny_llama_dir, [12, 9, 15, 7, 11, 10], ["a", "a", "b", "b", "c", "c"],
              minibatches=2),
        # LoRA: only the adapters' gradients are summed across ranks (the rest are frozen)
        _case("lora", tiny_llama_dir, [12, 9, 15, 7], ["a", "a", "b", "b"], lora_rank=4,
              lora_alpha=8.0),
        # frozen lower layers: only the trained layers' gradients exist and are summed
        _case("freeze", tiny_llama_dir, [12, 9, 15, 7], ["a", "a", "b", "b"], freeze_layers=1),
        # gradient checkpointing: each rank runs its layers again in its backward
        _case("checkpointing", tiny_llama_dir, [12, 9, 15, 7], ["a", "a", "b", "b"],
              gradient_checkpointing=True),
    ]
    single = {c[0]: one_step(Actor(tiny_llama_dir, c[1]), c) for c in cases}

    assert launch_workers(2, rank_worker, tiny_llama_dir, cases, str(tmp_path)) == 0

    for name, cfg, batch, _, replay in cases:
        one = single[name]
        r0 = torch.load(tmp_path / f"{name}.rank0.pt")
        r1 = torch.load(tmp_path / f"{name}.rank1.pt")
        grad_err, weight_err = _max_rel(r0["grads"], one["grads"]), _max_abs(r0["weights"],
                                                                           one["weights"])
        print(f"{name}: max |g2 - g1| / max |g1| = {grad_err:.2e}; "
              f"max |w2 - w1| = {weight_err:.2e}")
        assert grad_err < GRAD_RTOL
        assert weight_err < WEIGHT_MAX_STEPS * cfg.lr
        assert _mean_abs(r0["weights"], one["weights"]) < WEIGHT_MEAN_ATOL
        assert _max_abs(one["weights"], {n: w.detach() for n, w in
                                         Actor(tiny_llama_dir, cfg).model.named_parameters()}) > 1e-4
        # the ranks applied the same summed gradients and hold the same weights, bit for bit
        assert all(torch.equal(r0["grads"][k], r1["grads"][k]) for k in r0["grads"])
        assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
        m1, m2 = one["metrics"], r0["metrics"]
        assert m2["n_tokens"] == m1["n_tokens"] == batch.num_trained_tokens
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
        assert m2["dp_world_size"] == 2
        if cfg.lora_rank:  # the gradients applied were the adapters' alone
            assert r0["grads"] and all(".lora_" in k for k in r0["grads"])
        if cfg.freeze_layers:
            assert r0["grads"] and all(k.startswith("model.layers.1.") or k == "model.norm.weight"
                                       for k in r0["grads"])
        assert r0["version"] == r1["version"] == one["version"] == 1  # once a batch
        # rank 1 took each minibatch's part, and with several its part of the proximal scoring
        assert r1["commands"] == (1 if cfg.minibatches == 1 else cfg.minibatches + 1)
        if replay is not None:
            assert m2["sft_replay_loss"] == pytest.approx(m1["sft_replay_loss"], rel=1e-5)
            assert m1["sft_replay_loss"] > 1  # a random model's NLL: the replay was scored
        if name.startswith("one-group"):
            assert m2["dp_rank_tokens_min"] == 0
        else:  # both ranks trained on something
            assert m2["dp_rank_tokens_min"] > 0


@pytest.mark.slow
def test_a_failed_rank_stops_the_others_and_the_launch_names_it() -> None:
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from relayrl.launch.distributed import launch_workers

    started = time.monotonic()
    # torch elastic names the first failure it observes: usually rank 0's own error, but on a
    # loaded machine rank 1 can see its peer's socket close and exit first; either way the
    # launch fails, names the cause, and does not leave rank 1 waiting
    with pytest.raises(ChildFailedError,
                       match=r"rank 0 failed on purpose|(closed|reset) by peer"):
        launch_workers(2, crash_on_rank0, 2)
    assert time.monotonic() - started < 120  # rank 1 was stopped, not left waiting


# -- `relayrl train CONFIG train.world_size=2` ---------------------------------------------------

AGENT = '''
"""Episodes made in-process (no gateway calls): two rows per group with different rewards."""
import torch
from relayrl.trajectory import TrajectoryRow
from relayrl.workflow import RolloutWorkflow
from relayrl.workflow import workflow_context as wc


class MadeUp(RolloutWorkflow):
    async def arun_episode(self, engine, data):
        ctx = wc.get()
        g = torch.Generator().manual_seed(100 * int(data["q"]) + ctx.sample_index)
        ids = torch.randint(10, 1000, (16,), generator=g).tolist()
        mask = [0] * 6 + [1] * 10
        row = TrajectoryRow(
            session_id=ctx.episode_id, task_id=str(data["q"]), segment_id=ctx.episode_id + "/s",
            style="concat", interaction_ids=[ctx.episode_id + "/c"], input_ids=ids,
            loss_mask=mask, logprobs=[-7.0 if m else 0.0 for m in mask],
            versions=[0 if m else -1 for m in mask], reward=float(ctx.sample_index),
            turn_spans=[(6, 16)], turn_rewards=[float(ctx.sample_index)])
        return {row.interaction_ids[-1]: row}
'''


@pytest.mark.slow
def test_relayrl_train_runs_two_ranks_end_to_end(tiny_llama_dir: str, tmp_path: Path) -> None:
    (tmp_path / "dist_agent.py").write_text(AGENT)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"q": i}) + "\n" for i in range(4)))
    # warm-up traces: a warm-start on rank 0, then 3 of them replayed in every step (PPO-ptx),
    # shared between the ranks; the KL's reference is the policy after the warm-start
    g = torch.Generator().manual_seed(7)
    write_jsonl([TrajectoryRow(
        session_id=f"t{i}", task_id="t", segment_id=f"t{i}/s", style="concat",
        interaction_ids=[f"t{i}/c"], input_ids=torch.randint(10, 1000, (14,), generator=g).tolist(),
        loss_mask=[0] * 6 + [1] * 8, logprobs=[0.0] * 6 + [-5.0] * 8, versions=[-1] * 6 + [0] * 8,
        reward=1.0, turn_spans=[(6, 14)], turn_rewards=[1.0]) for i in range(4)],
        tmp_path / "traces.jsonl")
    (tmp_path / "config.yaml").write_text(textwrap.dedent(f"""\
        experiment_name: ddp
        trial_name: t
        fileroot: {tmp_path / "runs"}
        model: {tiny_llama_dir}
        workflow: dist_agent.MadeUp
        data: {{train: {tmp_path / "data.jsonl"}}}
        rollout: {{group_size: 2, batch_size: 2, progress: false, episode_timeout_s: 60}}
        train: {{total_steps: 2, lr: 1.0e-4, bf16: false, checkpoint_every: 0,
                 save_optimizer: false, sft_replay_coef: 0.5, sft_replay_rows: 3,
                 kl_coef: 0.05}}
        sft: {{data: {tmp_path / "traces.jsonl"}, rows_per_step: 2, lr: 1.0e-2}}
        """))
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "relayrl.cli", "train",
                           str(tmp_path / "config.yaml"), "train.world_size=2"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "runs" / "ddp" / "t"
    steps = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "loss" in s]
    assert [s["step"] for s in trained] == [1, 2]
    for s in trained:  # two ranks, one group each
        assert s["dp_world_size"] == 2 and s["dp_rank_tokens_min"] == s["dp_rank_tokens_max"] == 20
        assert s["n_tokens"] == 40
        assert s["sft_replay_loss"] > 1  # the tiny random model's NLL, summed over the ranks
    # Both ranks score the KL against the model as loaded: the warm-start's move shows at step 1
    assert trained[0]["ref_kl"] > 0 and trained[1]["ref_kl"] > 0
    # the last step's checkpoint
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]
    checkpoint = run / "checkpoints" / "step_2"
    assert json.loads((checkpoint / "relayrl_state.json").read_text())["version"] == 2
