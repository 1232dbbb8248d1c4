"""`train.gradient_checkpointing`: the step is the one without it (every layout, shared prefixes
included), and the forward keeps far less for the backward."""

from __future__ import annotations

import pytest
import torch

from relayrl.errors import ConfigError
from relayrl.train.actor import Actor
from relayrl.train.advantages import broadcast_to_tokens
from relayrl.train.config import TrainConfig
from relayrl.train.packing import TrainBatch

from .test_actor import step_gradients
from .test_shared_prefix import LONG_QUESTION, QUESTION, agent_batch

NO_CLIP = dict(lr=1e-2, grad_clip=0.0, bf16=False)


def rl_batch(actor: Actor, question_len: int = QUESTION) -> tuple[TrainBatch, torch.Tensor]:
    """Agent-shaped rows (one system prompt, two questions) scored by the actor itself."""
    batch = agent_batch(actor.model.config.vocab_size, question_len=question_len)
    batch = TrainBatch(**{**batch.__dict__, "behav_logprobs_B_T": actor.compute_logprobs(batch)})
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.5, -2.0])
    return batch, broadcast_to_tokens(adv, batch.loss_mask_B_T)


@pytest.mark.parametrize(("packing", "share_prefix", "question"),
                         [("unpad", True, QUESTION), ("pad", True, QUESTION),
                          ("pad", False, QUESTION), ("unpad", False, QUESTION),
                          ("unpad", True, LONG_QUESTION)],
                         ids=["unpad", "pad", "pad-unshared", "unpad-unshared", "unpad-stems"])
def test_the_step_is_the_one_without_checkpointing(tiny_llama_dir: str, packing: str,
                                                   share_prefix: bool, question: int) -> None:
    cfg = dict(packing=packing, share_prefix=share_prefix, **NO_CLIP)
    plain = Actor(tiny_llama_dir, TrainConfig(**cfg))
    ours = Actor(tiny_llama_dir, TrainConfig(gradient_checkpointing=True, **cfg))
    batch, adv = rl_batch(plain, question)
    if share_prefix:
        assert all(mb.prefix_len > 0 for mb in plain.micro_batches(batch))
    # a re-run layer gathers its stem's keys again
    assert any(mb.piece_stems is not None for mb in plain.micro_batches(batch)) == (
        question == LONG_QUESTION)
    theirs, their_grads = step_gradients(plain, batch, adv)
    mine, my_grads = step_gradients(ours, batch, adv)
    assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    assert my_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        torch.testing.assert_close(my_grads[name], grad, rtol=1e-5, atol=1e-7)
    # and it scores without grad as before (the proximal logprobs of the next step)
    torch.testing.assert_close(ours.compute_logprobs(batch), plain.compute_logprobs(batch),
                               rtol=1e-6, atol=1e-6)


def activation_bytes(actor: Actor, batch: TrainBatch) -> int:
    """Bytes the decoder's forward of `batch` keeps for the backward, the weights aside."""
    weights = {p.untyped_storage().data_ptr() for p in actor.compute_model.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.untyped_storage().data_ptr() not in weights:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for mb in actor.micro_batches(batch):
            actor._hidden(actor.compute_model.get_decoder(), mb)
    return total


@pytest.mark.parametrize("share_prefix", [True, False])
def test_the_forward_keeps_less_for_the_backward(tiny_llama_dir: str, share_prefix: bool) -> None:
    cfg = dict(share_prefix=share_prefix, **NO_CLIP)
    plain = Actor(tiny_llama_dir, TrainConfig(**cfg))
    ours = Actor(tiny_llama_dir, TrainConfig(gradient_checkpointing=True, **cfg))
    batch, _ = rl_batch(plain)
    kept, full = activation_bytes(ours, batch), activation_bytes(plain, batch)
    assert kept < 0.5 * full, (kept, full)


def test_compile_with_checkpointing_is_refused() -> None:
    with pytest.raises(ConfigError, match="gradient_checkpointing with compile"):
        TrainConfig(gradient_checkpointing=True, compile=True)
