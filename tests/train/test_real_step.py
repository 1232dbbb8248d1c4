"""One real training step on the default model: it raises the logprobs of replies with a positive
advantage and lowers those with a negative one."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from relayrl.train.actor import Actor
from relayrl.train.advantages import compute_advantages
from relayrl.train.config import TrainConfig
from relayrl.train.packing import TrainBatch

pytestmark = pytest.mark.slow

REPLIES = [  # (reply, reward)
    ("2 + 2 = 4.<|im_end|>", 1.0),
    ("The answer is 5, I think.<|im_end|>", 0.0),
    ("It equals four.<|im_end|>", 1.0),
    ("I don't know what numbers are.<|im_end|>", 0.0),
]


def one_group(model_dir: str) -> TrainBatch:
    """One prompt, four replies (a group), trained on the reply tokens only."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                     tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    rows = [prompt_ids + tok.encode(reply, add_special_tokens=False) for reply, _ in REPLIES]
    b, t = len(rows), max(map(len, rows))
    ids = torch.zeros(b, t, dtype=torch.long)
    attention = torch.zeros(b, t, dtype=torch.bool)
    loss = torch.zeros(b, t, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = True
        loss[i, len(prompt_ids) : len(row)] = True
    return TrainBatch(ids, attention, loss, torch.zeros(b, t), torch.zeros(b, t, dtype=torch.long),
                      torch.tensor([r for _, r in REPLIES]), ("e0", "e1", "e2", "e3"), ("g",) * b)


def test_one_step_moves_logprobs_the_way_the_advantages_point(model_dir: str) -> None:
    # Default lr (1e-6): Adam's first step moves every weight by about lr, coherently, which
    # on this model shifts reply logprobs by 0.1-1.4 nats in bf16 (AMX CPUs) and by 0.01-0.07
    # in fp32 (bf16 "auto" is off on CPUs without bf16 units); a 100-token budget splits the
    # four rows (43-48 tokens) into two micro-batches, so gradients accumulate across passes.
    cfg = TrainConfig(micro_batch_tokens=100)
    actor = Actor(model_dir, cfg)
    batch = one_group(model_dir)
    before_B_T = actor.compute_logprobs(batch)
    batch = TrainBatch(**{**batch.__dict__, "behav_logprobs_B_T": before_B_T})  # on-policy
    weight = actor.model.get_decoder().layers[0].mlp.up_proj.weight
    weight_before = weight.detach().clone()

    adv = compute_advantages(batch, cfg)
    metrics = actor.update(adv.batch, adv.adv_B_T)

    assert metrics["n_tokens"] == batch.num_trained_tokens
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert not torch.equal(weight.detach(), weight_before)
    after_B_T = actor.compute_logprobs(batch)
    mask = batch.loss_mask_B_T.float()
    delta_B = ((after_B_T - before_B_T) * mask).sum(-1) / mask.sum(-1)
    positive, negative = delta_B[[0, 2]], delta_B[[1, 3]]
    assert (positive > 0).all() and positive.mean() > 0.005, delta_B
    assert (negative < -0.005).all(), delta_B
