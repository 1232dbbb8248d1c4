"""Micro-batching: budgets are kept, and padded or packed micro-batches score every trained
token exactly as a one-row forward pass does (no row sees another)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.errors import ConfigError, InvalidRequest
from relayrl.train.actor import Actor
from relayrl.train.advantages import compute_advantages
from relayrl.train.config import TrainConfig
from relayrl.train.packing import TrainBatch, micro_batches, plan_micro_batches
from relayrl.trajectory.export import TrajectoryRow, to_tensor_dict

from .conftest import random_batch, reference_logprobs

LENGTHS = [23, 7, 16, 30, 11, 4]


def test_pad_plan_groups_similar_lengths_within_the_padded_budget() -> None:
    # Longest first: 10 alone (2 x 10 > 16), then 8 + 5 (2 x 8 = 16), then 3.
    assert plan_micro_batches([10, 3, 8, 5], 16, "pad") == [[0], [2, 3], [1]]
    assert plan_micro_batches([10, 3, 8, 5], 20, "pad") == [[0, 2], [3, 1]]


def test_pack_plan_is_first_fit_decreasing_within_the_token_budget() -> None:
    # 10 -> bin 0 (room 6); 8 -> bin 1 (room 8); 5 -> bin 0 (room 1); 3 -> bin 1.
    assert plan_micro_batches([10, 3, 8, 5], 16, "pack") == [[0, 3], [2, 1]]


def test_a_row_longer_than_the_budget_goes_alone() -> None:
    assert plan_micro_batches([50, 5, 5], 16, "pad") == [[0], [1, 2]]
    assert plan_micro_batches([50, 5, 5], 16, "pack") == [[0], [1, 2]]


def test_micro_batches_skip_rows_without_trained_tokens_and_cover_every_trained_token() -> None:
    batch = random_batch(LENGTHS, vocab=100)
    mask = batch.loss_mask_B_T.clone()
    mask[1] = False
    for packing in ("pad", "unpad", "pack"):
        mbs = micro_batches(batch, 32, packing, mask)
        rows = sorted(r for mb in mbs for r in mb.rows)
        assert rows == [0, 2, 3, 4, 5]
        covered = torch.cat([mb.source_N for mb in mbs]).sort().values
        assert torch.equal(covered, mask.reshape(-1).nonzero()[:, 0])
        for mb in mbs:
            assert mb.num_tokens <= 32 or len(mb.rows) == 1
            # Each trained token in the micro-batch is the batch's token at its source.
            assert torch.equal(mb.input_ids_M_L[mb.target_m_N, mb.target_l_N],
                               mb.take(batch.input_ids_B_T))


@pytest.mark.parametrize("packing", ["pad", "unpad", "pack"])
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_micro_batched_logprobs_equal_one_row_at_a_time(
    packing: str, model_fixture: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(model_fixture)
    cfg = TrainConfig(micro_batch_tokens=48, packing=packing, bf16=False)
    actor = Actor(path, cfg)
    batch = random_batch(LENGTHS, vocab=actor.model.config.vocab_size, seed=3)
    assert len(micro_batches(batch, 48, packing)) < len(LENGTHS)  # rows really share passes
    got = actor.compute_logprobs(batch)
    want = reference_logprobs(actor.model, batch)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_packing_without_restarting_positions_would_leak_across_rows(tiny_llama_dir: str) -> None:
    # The control for the test above: the same rows concatenated as one sequence do differ.
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    batch = random_batch([12, 12], vocab=model.config.vocab_size, seed=5)
    want = reference_logprobs(model, batch)
    ids = batch.input_ids_B_T.reshape(1, -1)
    with torch.no_grad():
        logp = model(ids, use_cache=False).logits[0].log_softmax(-1)
    second_row = logp[12:-1].gather(-1, ids[0, 13:, None])[:, 0]
    assert (second_row - want[1, 1:]).abs()[batch.loss_mask_B_T[1, 1:]].max() > 1e-2


def test_batches_that_train_a_first_token_or_are_left_padded_are_refused() -> None:
    batch = random_batch([5, 5], vocab=10)
    mask = batch.loss_mask_B_T.clone()
    mask[0, 0] = True
    with pytest.raises(InvalidRequest, match="first token"):
        TrainBatch(**{**batch.__dict__, "loss_mask_B_T": mask})
    left = torch.tensor([[False, True, True, True, True], [True] * 5])
    with pytest.raises(InvalidRequest, match="right-padded"):
        TrainBatch(**{**batch.__dict__, "attention_mask_B_T": left,
                      "loss_mask_B_T": batch.loss_mask_B_T & left})


def test_select_keeps_rows_and_their_labels_together() -> None:
    batch = random_batch([5, 6, 7], vocab=10)
    picked = batch.select([2, 0])
    assert picked.episode_ids == ("e2", "e0")
    assert torch.equal(picked.input_ids_B_T, batch.input_ids_B_T[[2, 0]])
    assert picked.rewards_B.tolist() == [2.0, 0.0]


def row(
    session: str, task: str, n_prompt: int, outputs: list[int], rewards: list[float]
) -> TrajectoryRow:
    """A concat row: a prompt, then per turn `k` sampled tokens followed by 2 tool tokens."""
    ids, mask, spans = list(range(n_prompt)), [0] * n_prompt, []
    for k in outputs:
        spans.append((len(ids), len(ids) + k))
        ids += [7] * k + [8, 8]
        mask += [1] * k + [0, 0]
    return TrajectoryRow(
        session_id=session, task_id=task, segment_id="s", style="concat",
        interaction_ids=[f"c{i}" for i in range(len(outputs))], input_ids=ids, loss_mask=mask,
        logprobs=[-0.5 * m for m in mask], versions=[0 if m else -1 for m in mask],
        reward=rewards[-1], turn_spans=spans, turn_rewards=rewards,
    )


def test_exported_rows_become_a_batch_with_labels_and_turn_spans() -> None:
    rows = [row("ep0", "task", 3, [2, 1], [1.0, 0.5]), row("ep1", "task", 4, [3], [0.0])]
    batch = TrainBatch.from_rows(rows)
    assert batch.episode_ids == ("ep0", "ep1") and batch.group_ids == ("task", "task")
    assert batch.turn_spans == (((3, 5), (7, 8)), ((4, 7),))
    assert batch.num_trained_tokens == 6
    assert batch.behav_logprobs_B_T[batch.loss_mask_B_T].eq(-0.5).all()
    adv = compute_advantages(batch, TrainConfig(advantage_source="turn", adv_norm="mean"))
    # Episode weights: ep0's two turns 1/2 each, ep1's turn 1: baseline (0.5 + 0.25 + 0) / 2.
    assert adv.adv_B_T[0, 3:5].tolist() == pytest.approx([0.625, 0.625])
    assert adv.adv_B_T[0, 7].item() == pytest.approx(0.125)
    assert adv.adv_B_T[1, 4:7].tolist() == pytest.approx([-0.375] * 3)


def test_extended_appends_rows_padded_to_the_longer_batch() -> None:
    short = TrainBatch.from_rows([row("ep0", "a", 3, [2], [1.0])])
    long = TrainBatch.from_rows([row("ep1", "b", 4, [3, 2], [0.0, 0.5])])
    both = short.extended(long)
    assert both.num_rows == 2 and both.input_ids_B_T.shape[1] == long.input_ids_B_T.shape[1]
    assert both.episode_ids == ("ep0", "ep1") and both.group_ids == ("a", "b")
    assert both.turn_spans == short.turn_spans + long.turn_spans
    n = int(short.lengths_B[0])
    assert torch.equal(both.input_ids_B_T[0, :n], short.input_ids_B_T[0])
    assert not both.attention_mask_B_T[0, n:].any() and not both.loss_mask_B_T[0, n:].any()
    assert torch.equal(both.behav_logprobs_B_T[1], long.behav_logprobs_B_T[0])
    assert both.num_trained_tokens == short.num_trained_tokens + long.num_trained_tokens
    # turn credit needs spans for every row: a batch without them drops them for all
    assert short.extended(random_batch([5], vocab=10)).turn_spans is None


def test_a_tensor_dict_without_behaviour_logprobs_is_refused() -> None:
    tensors = to_tensor_dict([row("ep0", "task", 3, [2], [1.0])])
    del tensors["logprobs"]
    with pytest.raises(InvalidRequest, match="logprobs"):
        TrainBatch.from_tensors(tensors, ["ep0"], ["task"])


def test_bucketed_micro_batches_round_lengths_up_and_score_the_same(tiny_llama_dir: str) -> None:
    batch = random_batch(LENGTHS, vocab=100, seed=4)
    mask = batch.loss_mask_B_T.clone()
    mask[3, 20:] = False  # row 3 (30 tokens) ends with 10 untrained tokens
    batch = TrainBatch(**{**batch.__dict__, "loss_mask_B_T": mask})
    mbs = micro_batches(batch, 48, "pad", bucket=16)
    for mb in mbs:
        length = mb.input_ids_M_L.shape[1]
        assert length % 16 == 0 and mb.num_tokens <= 48
    # 23 and (row 3 cut to) 20 round to 32, beyond the batch's 30 columns; the rest to 16.
    assert sorted(mb.input_ids_M_L.shape[1] for mb in mbs) == [16, 16, 32, 32]
    covered = torch.cat([mb.source_N for mb in mbs]).sort().values
    assert torch.equal(covered, mask.reshape(-1).nonzero()[:, 0])

    exact = Actor(tiny_llama_dir, TrainConfig(micro_batch_tokens=48, bf16=False, length_bucket=1))
    bucketed = Actor(tiny_llama_dir, TrainConfig(micro_batch_tokens=48, bf16=False,
                                                 length_bucket=16))
    batch = random_batch(LENGTHS, vocab=exact.model.config.vocab_size, seed=4)
    assert torch.allclose(bucketed.compute_logprobs(batch), exact.compute_logprobs(batch),
                          atol=1e-5)


def test_rows_are_cut_after_their_last_trained_token() -> None:
    batch = random_batch([12, 12], vocab=100, seed=6)
    mask = batch.loss_mask_B_T.clone()
    mask[:, 7:] = False
    mask[:, 6] = True
    batch = TrainBatch(**{**batch.__dict__, "loss_mask_B_T": mask})
    (mb,) = micro_batches(batch, 100, "pad")
    assert mb.input_ids_M_L.shape == (2, 7)
    (mb,) = micro_batches(batch, 100, "pack")
    assert mb.input_ids_M_L.shape == (1, 14)


def test_unpad_with_an_attention_kernel_that_cannot_place_its_rows_is_refused() -> None:
    with pytest.raises(ConfigError, match="packing=unpad needs attn_implementation=sdpa"):
        TrainConfig(attn_implementation="flash_attention_2")
    assert TrainConfig(attn_implementation="flash_attention_2", packing="pack").packing == "pack"
