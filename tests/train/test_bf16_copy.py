"""bf16 updates run on a bf16 copy of the fp32 master weights: the same loss and gradients as an
fp32 step, within bf16 tolerance, and the copy follows the fp32 master weights.

Tolerances. The copy rounds to bf16 (8 significant bits), the residual stream included. It is
compared with an fp32 step on the same batch and the same proximal logprobs (so the loss
depends on the logprobs each computes). On these tiny models (large random init, so large
activations: a harsh case) the copy's loss is within 5% of fp32's (measured 0.6-2.4%); its
gradient within 40% of fp32's in relative L2 over all parameters (measured 13-24%) and pointing
the same way (cosine with fp32's > 0.95, measured 0.973-0.992). On SmolLM2 itself (4 rows of
~440 tokens, on-policy) the gradient was 4.5% from fp32's.
"""

from __future__ import annotations

import pytest
import torch

from relayrl.train.actor import Actor
from relayrl.train.advantages import broadcast_to_tokens
from relayrl.train.config import TrainConfig
from relayrl.train.packing import TrainBatch
from relayrl.train.sft import sft_step

from .conftest import random_batch

LENGTHS = [40, 33, 25, 12]


def batch_for(path: str) -> tuple[TrainBatch, torch.Tensor, torch.Tensor]:
    """(batch, advantages, proximal logprobs): proximal 0.1 nats above the fp32 model's
    logprobs, so the loss depends on the logprobs a step computes (ratios about 0.9, inside the
    clip), behaviour 0.2 below the proximal; advantages of both signs."""
    scorer = Actor(path, TrainConfig(bf16=False))
    batch = random_batch(LENGTHS, vocab=scorer.model.config.vocab_size, seed=11)
    prox = scorer.compute_logprobs(batch) + 0.1 * batch.loss_mask_B_T
    batch = TrainBatch(**{**batch.__dict__, "behav_logprobs_B_T": prox - 0.2 * batch.loss_mask_B_T})
    adv = broadcast_to_tokens(torch.tensor([1.0, -0.5, 2.0, -1.0]), batch.loss_mask_B_T)
    return batch, adv, prox


def step(path: str, **cfg: object) -> tuple[dict[str, float], torch.Tensor]:
    """One update; its metrics and the flat fp32 gradient the optimizer step saw."""
    actor = Actor(path, TrainConfig(grad_clip=0.0, micro_batch_tokens=64, **cfg))  # type: ignore[arg-type]
    seen: list[torch.Tensor] = []
    original = actor.optimizer.step

    def capture(*args: object, **kwargs: object) -> None:
        seen.append(torch.cat([p.grad.reshape(-1) for p in actor.model.parameters()]))
        assert all(p.grad.dtype == torch.float32 for p in actor.model.parameters())
        original(*args, **kwargs)  # type: ignore[arg-type]

    actor.optimizer.step = capture  # type: ignore[method-assign]
    batch, adv, prox = batch_for(path)
    return actor.update(batch, adv, prox), seen[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of a from b."""
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_the_copy_gives_fp32s_loss_and_gradients_within_bf16_tolerance(
    model_fixture: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(model_fixture)
    exact, g_exact = step(path, bf16=False)
    new, g_new = step(path, bf16=True)
    assert exact["n_tokens"] == new["n_tokens"] > 50
    assert abs(exact["loss"]) > 0.05
    assert new["loss"] == pytest.approx(exact["loss"], rel=0.05)
    assert rel(g_new, g_exact) < 0.4
    assert float(torch.nn.functional.cosine_similarity(g_new, g_exact, dim=0)) > 0.95


def test_without_bf16_there_is_no_copy(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(bf16=False))
    assert actor.compute_model is actor.model and not actor.bf16_copy


def test_the_copy_is_bf16_tied_keeps_fp32_rotary_and_follows_every_step(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(lr=1e-2, bf16=True))
    copy = actor.compute_model
    assert copy is not actor.model
    assert all(p.dtype == torch.bfloat16 for p in copy.parameters())
    assert copy.get_input_embeddings().weight is copy.get_output_embeddings().weight
    assert copy.model.rotary_emb.inv_freq.dtype == torch.float32

    def in_step() -> bool:
        return all(torch.equal(q, p.detach().to(torch.bfloat16))
                   for p, q in zip(actor.model.parameters(), copy.parameters(), strict=True))

    batch, adv, _ = batch_for(tiny_llama_dir)
    before = actor.model.get_decoder().layers[0].mlp.up_proj.weight.detach().clone()
    actor.update(batch, adv)
    assert not torch.equal(actor.model.get_decoder().layers[0].mlp.up_proj.weight, before)
    assert in_step()
    assert all(p.grad is None for p in copy.parameters())  # folded into the masters, dropped
    sft_step(actor, batch, lr=1e-2)
    assert in_step()
    with torch.no_grad():  # a direct edit of the masters reaches the copy on request
        actor.model.get_decoder().norm.weight.mul_(2)
    actor.weights_changed()
    assert in_step()


def test_reference_logprobs_in_bf16_start_equal_to_the_policys(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(bf16=True, kl_coef=0.1))
    batch, _, _ = batch_for(tiny_llama_dir)
    assert torch.equal(actor.reference_logprobs(batch), actor.compute_logprobs(batch))


@pytest.mark.slow
def test_compiled_layers_give_the_eager_step(tiny_llama_dir: str) -> None:
    # fp32, so compiled and eager must agree to float rounding (fusion reorders sums).
    (eager, g_eager), (compiled, g_compiled) = (step(tiny_llama_dir, bf16=False),
                                                step(tiny_llama_dir, bf16=False, compile=True))
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-4)
    assert rel(g_compiled, g_eager) < 1e-3
