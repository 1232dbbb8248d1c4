"""The actor on a tiny model: micro-batching does not change the step, checkpoints round-trip
(weights, optimizer, step), weights reach the engine, metrics are written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.train.actor import Actor
from relayrl.train.advantages import broadcast_to_tokens
from relayrl.train.checkpoint import latest_checkpoint, list_checkpoints, read_training_state
from relayrl.train.config import TrainConfig
from relayrl.train.metrics import MetricsLogger, read_metrics
from relayrl.train.packing import TrainBatch, minibatch_rows

from .conftest import random_batch, tokenizer_files
from .test_shared_prefix import SYSTEM, agent_batch

LENGTHS = [20, 9, 14, 5]


def signed_batch(actor: Actor, seed: int = 0) -> tuple[TrainBatch, torch.Tensor]:
    """A batch whose behaviour logprobs are the actor's own, advantages +1, -0.5, +2, -1."""
    batch = random_batch(LENGTHS, vocab=actor.model.config.vocab_size, seed=seed)
    batch = TrainBatch(**{**batch.__dict__, "behav_logprobs_B_T": actor.compute_logprobs(batch)})
    adv_B_T = broadcast_to_tokens(torch.tensor([1.0, -0.5, 2.0, -1.0]), batch.loss_mask_B_T)
    return batch, adv_B_T


def step_gradients(actor: Actor, batch: TrainBatch, adv: torch.Tensor,
                   replay: TrainBatch | None = None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Run `update`, capturing the (clipped) gradients the optimizer step sees."""
    captured: dict[str, torch.Tensor] = {}
    original = actor.optimizer.step

    def step(*args: object, **kwargs: object) -> None:
        captured.update({n: p.grad.clone() for n, p in actor.model.named_parameters()
                         if p.grad is not None})
        original(*args, **kwargs)  # type: ignore[arg-type]

    actor.optimizer.step = step  # type: ignore[method-assign]
    return actor.update(batch, adv, replay=replay), captured


@pytest.mark.parametrize("agg", ["token", "seq-mean-token-mean"])
def test_the_step_is_the_same_whatever_the_micro_batch_budget(tiny_llama_dir: str, agg: str) -> None:
    whole = Actor(tiny_llama_dir, TrainConfig(micro_batch_tokens=4096, bf16=False, loss_agg=agg))
    split = Actor(tiny_llama_dir, TrainConfig(micro_batch_tokens=20, bf16=False, loss_agg=agg))
    batch, adv = signed_batch(whole)
    (a, grads_a), (b, grads_b) = step_gradients(whole, batch, adv), step_gradients(split, batch, adv)
    assert abs(a["loss"]) > 0.1
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert a["n_tokens"] == b["n_tokens"] == batch.num_trained_tokens
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, g in grads_a.items():
        # fp32 sums in another order: a gradient's near-zero entries move by a few 1e-6 of its
        # largest one (on an EPYC, 6e-6 of 2.0), so the absolute tolerance follows its scale
        scale = float(g.abs().max())
        assert torch.allclose(g, grads_b[name], rtol=1e-4, atol=1e-5 * scale), name


def test_an_update_bumps_step_and_version_and_changes_the_weights(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(lr=1e-3, bf16=False))
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    batch, adv = signed_batch(actor)
    metrics = actor.update(batch, adv)
    assert (actor.step, actor.version) == (1, 1)
    assert metrics["ratio_mean"] == pytest.approx(1.0)  # on-policy: proximal = current
    changed = [k for k, v in actor.model.state_dict().items() if not torch.equal(v, before[k])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed


def test_a_batch_with_nothing_to_train_takes_no_step(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(bf16=False))
    batch, adv = signed_batch(actor)
    empty = TrainBatch(**{**batch.__dict__, "loss_mask_B_T": torch.zeros_like(batch.loss_mask_B_T)})
    assert actor.update(empty, adv)["n_tokens"] == 0
    assert (actor.step, actor.version) == (0, 0)


def test_a_replayed_sft_batch_adds_its_weighted_nll_gradient_to_the_rl_step(
    tiny_llama_dir: str,
) -> None:
    # PPO-ptx: the step's gradient is the RL loss's plus coef x the replay's mean-token NLL's
    cfg = TrainConfig(bf16=False, grad_clip=0.0, sft_replay_coef=0.5)
    plain, mixed = Actor(tiny_llama_dir, cfg), Actor(tiny_llama_dir, cfg)
    batch, adv = signed_batch(plain)
    replay = random_batch([12, 7], vocab=plain.model.config.vocab_size, seed=5)
    rl_metrics, rl_grads = step_gradients(plain, batch, adv)
    metrics, grads = step_gradients(mixed, batch, adv, replay=replay)
    assert "sft_replay_loss" not in rl_metrics
    assert metrics["loss"] == pytest.approx(rl_metrics["loss"], rel=1e-5)

    reference = Actor(tiny_llama_dir, cfg)
    reference.optimizer.zero_grad(set_to_none=True)
    mb_logprobs = [reference.token_logprobs(reference.model, mb)
                   for mb in reference.micro_batches(replay)]
    nll = -torch.cat(mb_logprobs).sum() / replay.num_trained_tokens
    nll.backward()
    assert metrics["sft_replay_loss"] == pytest.approx(float(nll.detach()), rel=1e-5)
    assert float(nll.detach()) > 1.0  # random tokens: the tiny model is far from imitating them
    for name, param in reference.model.named_parameters():
        expected = rl_grads[name] + 0.5 * param.grad
        scale = float(expected.abs().max())
        assert torch.allclose(grads[name], expected, rtol=1e-4, atol=1e-5 * scale), name
    assert any(not torch.allclose(grads[n], rl_grads[n]) for n in grads)


def test_a_replay_is_ignored_when_its_weight_is_zero_and_skipped_with_an_empty_step(
    tiny_llama_dir: str,
) -> None:
    off = Actor(tiny_llama_dir, TrainConfig(bf16=False))
    batch, adv = signed_batch(off)
    replay = random_batch([12, 7], vocab=off.model.config.vocab_size, seed=5)
    assert "sft_replay_loss" not in off.update(batch, adv, replay=replay)
    on = Actor(tiny_llama_dir, TrainConfig(bf16=False, sft_replay_coef=1.0))
    empty = TrainBatch(**{**batch.__dict__, "loss_mask_B_T": torch.zeros_like(batch.loss_mask_B_T)})
    metrics = on.update(empty, adv, replay=replay)
    assert metrics["n_tokens"] == 0 and "sft_replay_loss" not in metrics
    assert (on.step, on.version) == (0, 0)


def test_kl_to_the_reference_starts_at_zero_and_grows_once_the_policy_moves(
    tiny_llama_dir: str,
) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(lr=1e-3, bf16=False, kl_coef=0.1))
    batch, adv = signed_batch(actor)
    first = actor.update(batch, adv)
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-6)
    second = actor.update(batch, adv)
    assert second["ref_kl"] > 1e-4
    assert second["kl_loss"] > 0


def test_minibatches_share_the_proximal_logprobs_so_later_steps_see_ratios(
    tiny_llama_dir: str,
) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(lr=1e-3, bf16=False))
    batch, adv = signed_batch(actor)
    batch = TrainBatch(**{**batch.__dict__, "versions_B_T": torch.zeros_like(batch.versions_B_T)})
    prox = actor.compute_logprobs(batch)
    parts = minibatch_rows(batch.num_rows, 2)
    assert parts == [[0, 1], [2, 3]]
    stats = [actor.update(batch.select(rows), adv[rows], prox[rows]) for rows in parts]
    assert stats[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert abs(stats[1]["ratio_mean"] - 1.0) > 1e-4  # the first step moved the policy
    assert stats[1]["staleness_mean"] == 1.0  # sampled by version 0, trained at version 1
    assert actor.version == 2


def test_warmup_ramps_the_learning_rate_linearly(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(lr=1e-4, warmup_steps=4, bf16=False))
    assert [actor.lr_at(s) for s in range(5)] == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4])


def test_engine_weights_are_shared_by_default_and_cloned_on_request(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(bf16=False))
    name = "model.layers.0.mlp.up_proj.weight"
    live = actor.model.state_dict()[name]
    assert actor.state_dict_for_engine()[name].data_ptr() == live.data_ptr()
    copied = actor.state_dict_for_engine(copy=True)[name]
    assert copied.data_ptr() != live.data_ptr() and torch.equal(copied, live)


def test_checkpoint_round_trips_weights_optimizer_and_step(tiny_llama_dir: str, tmp_path: Path) -> None:
    cfg = TrainConfig(lr=1e-3, bf16=False, keep_checkpoints=2)
    actor = Actor(tiny_llama_dir, cfg)
    batch, adv = signed_batch(actor)
    root = tmp_path / "checkpoints"
    for _ in range(3):
        actor.update(batch, adv)
        actor.save_checkpoint(root)
    assert [p.name for p in list_checkpoints(root)] == ["step_2", "step_3"]
    path = latest_checkpoint(root)
    assert path == root / "step_3"
    assert read_training_state(path).version == 3
    assert tokenizer_files(tiny_llama_dir) <= tokenizer_files(path)

    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = batch.input_ids_B_T[:1, :20]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, actor.model(ids).logits)

    resumed = Actor.resume(path, cfg)
    assert (resumed.step, resumed.version) == (3, 3)
    want = actor.optimizer.state_dict()["state"]
    got = resumed.optimizer.state_dict()["state"]
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k]["exp_avg_sq"], got[k]["exp_avg_sq"]) for k in want)
    # Resumed and original take the same next step.
    actor.update(batch, adv)
    resumed.update(batch, adv)
    for p, q in zip(actor.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_metrics_go_to_jsonl_tensorboard_and_a_plot(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path / "logs") as logger:
        for step in range(1, 4):
            logger.log(step, {"reward_mean": step / 10, "loss": 1.0 / step, "note": "x"})  # type: ignore[dict-item]
        png = logger.plot(tmp_path / "curve.png")
    records = read_metrics(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1] == {"step": 2, "reward_mean": 0.2, "loss": 0.5}
    assert list((tmp_path / "logs").glob("events.out.tfevents.*"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_rows_join_the_rl_rows_micro_batch_and_its_prefix_pass(tiny_llama_dir: str) -> None:
    # Warm-up traces start with the agent's system prompt like the RL rows: scored together,
    # the prompt runs once, and the step is the one the two losses would take apart.
    cfg = TrainConfig(bf16=False, grad_clip=0.0, sft_replay_coef=0.5)
    joint, plain = Actor(tiny_llama_dir, cfg), Actor(tiny_llama_dir, cfg)
    rows = agent_batch(joint.model.config.vocab_size, groups=3)
    batch, replay = rows.select(range(6)), rows.select([6, 7, 8])
    adv = broadcast_to_tokens(torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]), batch.loss_mask_B_T)
    metrics, grads = step_gradients(joint, batch, adv, replay=replay)

    apart = [mb for b in (batch, replay) for mb in plain.micro_batches(b)]
    together = plain.micro_batches(batch.extended(replay))
    assert len(together) == 1 and together[0].prefix_len == SYSTEM
    assert metrics["forward_tokens"] == together[0].num_tokens
    assert metrics["forward_tokens"] <= sum(mb.num_tokens for mb in apart) - SYSTEM

    rl_metrics, rl_grads = step_gradients(plain, batch, adv)
    assert metrics["loss"] == pytest.approx(rl_metrics["loss"], rel=1e-5)
    assert metrics["n_tokens"] == rl_metrics["n_tokens"] == batch.num_trained_tokens
    reference = Actor(tiny_llama_dir, cfg)
    reference.optimizer.zero_grad(set_to_none=True)
    nll = reference.nll_backward(replay, coef=0.5)
    assert metrics["sft_replay_loss"] == pytest.approx(nll, rel=1e-5)
    for name, param in reference.model.named_parameters():
        expected = rl_grads[name] + param.grad
        scale = float(expected.abs().max())
        assert torch.allclose(grads[name], expected, rtol=1e-4, atol=1e-5 * scale), name
