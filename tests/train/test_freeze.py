"""`train.freeze_layers`: the embeddings and the lowest decoder layers stay as loaded, the layers
above get exactly the gradient full training would give them, and a run resumes only as it ran."""

from __future__ import annotations

import pytest
import torch

from relayrl.errors import ConfigError
from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig

from .test_actor import signed_batch, step_gradients

NO_CLIP = dict(lr=1e-2, grad_clip=0.0, bf16=False)  # clipping would mix the frozen norms in


def trained_names(actor: Actor) -> set[str]:
    in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    return {n for n, p in actor.model.named_parameters() if id(p) in in_optimizer}


def test_the_layers_above_get_full_trainings_gradient_and_the_rest_stay(
        tiny_llama_dir: str) -> None:
    frozen = Actor(tiny_llama_dir, TrainConfig(freeze_layers=1, **NO_CLIP))
    full = Actor(tiny_llama_dir, TrainConfig(**NO_CLIP))
    top = {n for n, _ in full.model.named_parameters()
           if n.startswith("model.layers.1.") or n == "model.norm.weight"}
    # the head is tied to the embeddings, so it is frozen with them
    assert trained_names(frozen) == top
    assert not frozen.model.get_output_embeddings().weight.requires_grad
    before = {k: v.clone() for k, v in frozen.model.state_dict().items()}
    batch, adv = signed_batch(full)
    ours, grads = step_gradients(frozen, batch, adv)
    theirs, full_grads = step_gradients(full, batch, adv)
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    assert grads.keys() == top
    for name in top:
        torch.testing.assert_close(grads[name], full_grads[name], rtol=1e-5, atol=1e-7)
    after = frozen.model.state_dict()
    assert {k for k in after if not torch.equal(after[k], before[k])} == top
    assert frozen.version == 1


def test_an_untied_head_still_trains(tiny_qwen2_dir: str) -> None:
    actor = Actor(tiny_qwen2_dir, TrainConfig(freeze_layers=1, **NO_CLIP))
    names = trained_names(actor)
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    assert not any(n.startswith("model.layers.0.") for n in names)
    batch, adv = signed_batch(actor)
    _, grads = step_gradients(actor, batch, adv)
    assert grads.keys() == names and grads["lm_head.weight"].abs().sum() > 0


def test_the_bf16_copy_freezes_alike(tiny_llama_dir: str) -> None:
    actor = Actor(tiny_llama_dir, TrainConfig(freeze_layers=1, lr=1e-2, bf16=True))
    assert actor.bf16_copy
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    batch, adv = signed_batch(actor)
    actor.update(batch, adv)
    after = actor.model.state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved and all(k.startswith("model.layers.1.") or k == "model.norm.weight"
                         for k in moved)
    assert all(p.grad is None for p in actor.compute_model.parameters())


def test_a_checkpoint_resumes_with_the_freeze_it_was_trained_with(
        tiny_llama_dir: str, tmp_path: object) -> None:
    cfg = TrainConfig(freeze_layers=1, **NO_CLIP)
    actor = Actor(tiny_llama_dir, cfg)
    batch, adv = signed_batch(actor)
    actor.update(batch, adv)
    path = actor.save_checkpoint(tmp_path)  # type: ignore[arg-type]
    resumed = Actor.resume(path, cfg)
    batch2, adv2 = signed_batch(actor, seed=3)
    assert actor.update(batch2, adv2)["loss"] == pytest.approx(
        resumed.update(batch2, adv2)["loss"], rel=1e-6)
    for key, value in actor.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[key], value, rtol=0, atol=1e-7)
    with pytest.raises(ConfigError, match="freeze_layers=0"):
        Actor.resume(path, TrainConfig(**NO_CLIP))


def test_impossible_freezes_are_refused(tiny_llama_dir: str) -> None:
    with pytest.raises(ConfigError, match="all 2 decoder layers"):
        Actor(tiny_llama_dir, TrainConfig(freeze_layers=2, bf16=False))
    with pytest.raises(ConfigError, match="freeze_layers must be >= 0"):
        TrainConfig(freeze_layers=-1)
    with pytest.raises(ConfigError, match="lora_rank"):
        TrainConfig(freeze_layers=1, lora_rank=8)
