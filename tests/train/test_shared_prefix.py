"""Shared prefixes: rows that start alike (an agent's episodes) run their common prefix once, and
the logprobs, gradients and updated weights are those of the full rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relayrl.train import packing
from relayrl.train.actor import Actor
from relayrl.train.advantages import compute_advantages
from relayrl.train.checkpoint import copy_tokenizer_files
from relayrl.train.config import TrainConfig
from relayrl.train.packing import (
    MIN_SHARED_PREFIX,
    MIN_STEM,
    TrainBatch,
    micro_batches,
    plan_by_length,
    plan_shared_prefix,
    plan_stems,
)

from .conftest import TINY, random_batch

SYSTEM, QUESTION = 40, 6
LONG_QUESTION = MIN_STEM + 6
"""A question whose tokens (all but the last, which scores the first reply token) make a stem."""


def agent_batch(vocab: int, groups: int = 2, per_group: int = 3, seed: int = 0,
                question_len: int = QUESTION) -> TrainBatch:
    """Rows shaped like GRPO groups of agent episodes: one system prompt for every row, one
    question per group, then each episode's own replies (trained) and tool results (not)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (SYSTEM,), generator=g)
    rows, trained = [], []
    for _ in range(groups):
        question = torch.randint(0, vocab, (question_len,), generator=g)
        for _ in range(per_group):
            n = int(torch.randint(12, 30, (), generator=g))
            rest = torch.randint(0, vocab, (n,), generator=g)
            rows.append(torch.cat([system, question, rest]))
            mask = torch.zeros(len(rows[-1]), dtype=torch.bool)
            start = SYSTEM + question_len
            mask[start:] = True
            mask[start + n // 2: start + n // 2 + 4] = False  # a tool result
            trained.append(mask)
    b, t = len(rows), max(len(r) for r in rows)
    ids = torch.zeros(b, t, dtype=torch.long)
    attention = torch.zeros(b, t, dtype=torch.bool)
    loss = torch.zeros(b, t, dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, trained, strict=True)):
        ids[i, :len(r)], attention[i, :len(r)], loss[i, :len(r)] = r, True, m
    return TrainBatch(
        input_ids_B_T=ids, attention_mask_B_T=attention, loss_mask_B_T=loss,
        behav_logprobs_B_T=torch.full((b, t), -2.0) * loss,
        versions_B_T=torch.zeros(b, t, dtype=torch.long),
        rewards_B=torch.tensor([float(i % 2) for i in range(b)]),
        episode_ids=tuple(f"e{i}" for i in range(b)),
        group_ids=tuple(f"g{i // per_group}" for i in range(b)),
    )


def test_rows_of_one_prompt_share_it_and_groups_share_the_system_prompt() -> None:
    batch = agent_batch(vocab=1000)
    # A budget for all six rows: one pass over the system prompt (the groups' questions differ).
    (mb,) = micro_batches(batch, 400, "pad", share_prefix=True)
    assert mb.prefix_len == SYSTEM and sorted(mb.rows) == list(range(6))
    assert torch.equal(mb.prefix_ids_P, batch.input_ids_B_T[0, :SYSTEM])
    # A budget for one group at a time: each group's pass covers its question too, but stops
    # before the position whose output scores the first trained token.
    mbs = micro_batches(batch, 140, "pad", share_prefix=True)
    assert sorted(sorted(mb.rows) for mb in mbs) == [[0, 1, 2], [3, 4, 5]]
    assert [mb.prefix_len for mb in mbs] == [SYSTEM + QUESTION - 1] * 2
    for mb in mbs:
        assert mb.num_tokens <= 140
        assert mb.num_tokens == mb.prefix_len + mb.input_ids_M_L.numel()
        assert torch.equal(mb.position_ids_M_L[:, 0], torch.full((3,), mb.prefix_len))
        # Every trained token is where the batch has it, counted from the end of the prefix.
        assert torch.equal(mb.input_ids_M_L[mb.target_m_N, mb.target_l_N],
                           mb.take(batch.input_ids_B_T))
        assert int(mb.target_l_N.min()) >= 1
    covered = torch.cat([mb.source_N for mb in mbs]).sort().values
    assert torch.equal(covered, batch.loss_mask_B_T.reshape(-1).nonzero()[:, 0])


def test_rows_without_a_long_common_prefix_are_padded_as_before() -> None:
    batch = random_batch([23, 7, 16, 30, 11, 4], vocab=100)
    shared = micro_batches(batch, 48, "pad", share_prefix=True)
    plain = micro_batches(batch, 48, "pad")
    assert [mb.rows for mb in shared] == [mb.rows for mb in plain]
    assert all(mb.prefix_ids_P is None for mb in shared)


def test_a_prefix_shorter_than_the_minimum_or_a_single_row_is_not_split() -> None:
    base = torch.arange(100)
    rows = [base[:60], torch.cat([base[:MIN_SHARED_PREFIX - 1], base[:29] + 200])]
    assert plan_shared_prefix(rows, [50, 50], 1000, 1) == [([0, 1], 0)]
    assert plan_shared_prefix([base[:60]], [50], 1000, 1) == [([0], 0)]
    # Trained from position 40 on: the shared part stops at 39 even though 60 tokens agree.
    assert plan_shared_prefix([base[:60], base[:60]], [40, 45], 1000, 1) == [([0, 1], 39)]


def test_one_long_row_gets_its_own_pass_instead_of_padding_or_splitting_the_rest() -> None:
    # 15 rows of one prompt with short replies and one with a long reply: all 16 padded to the
    # long one do not fit the budget, and a split blind to lengths pads half of them to it.
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 1000, (SYSTEM,), generator=g)
    lengths = [20 + i % 5 for i in range(15)] + [120]
    rows = [torch.cat([system, torch.randint(0, 1000, (n,), generator=g)]) for n in lengths]
    first = [SYSTEM + 2] * 16
    budget = SYSTEM + 15 * 30
    by_length = plan_by_length(rows, first, budget, 1)
    assert sorted(map(sorted, (r for r, _ in by_length))) == [list(range(15)), [15]]
    assert dict((len(r), p) for r, p in by_length) == {15: SYSTEM, 1: 0}

    def tokens(plan: list[tuple[list[int], int]]) -> int:
        return sum(p + len(r) * (max(len(rows[i]) for i in r) - p) for r, p in plan)

    assert tokens(by_length) == SYSTEM + 15 * 24 + len(rows[15])
    assert tokens(by_length) < tokens(plan_shared_prefix(rows, first, budget, 1))

    # micro_batches takes that plan, and every trained token is scored once.
    b, t = 16, max(map(len, rows))
    ids, loss = torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], loss[i, SYSTEM + 2:len(r)] = r, True
    batch = TrainBatch(input_ids_B_T=ids, attention_mask_B_T=ids >= 0, loss_mask_B_T=loss,
                       behav_logprobs_B_T=torch.zeros(b, t), versions_B_T=torch.zeros(b, t).long(),
                       rewards_B=torch.zeros(b), episode_ids=tuple(map(str, range(b))),
                       group_ids=("g",) * b)
    mbs = micro_batches(batch, budget, "pad", share_prefix=True)
    assert sorted(len(mb.rows) for mb in mbs) == [1, 15]
    assert sum(mb.num_tokens for mb in mbs) == tokens(by_length)
    covered = torch.cat([mb.source_N for mb in mbs]).sort().values
    assert torch.equal(covered, loss.reshape(-1).nonzero()[:, 0])


def test_unpadded_micro_batches_hold_each_row_s_own_tokens_once_after_the_prefix() -> None:
    batch = agent_batch(vocab=1000)
    needed = (batch.loss_mask_B_T.cumsum(1).argmax(1) + 1).tolist()  # up to the last trained
    # A budget for all six rows: one pass, the system prompt once, then the rows' own tokens
    # end to end (the groups' questions differ), padded only up to the bucket at the end.
    (mb,) = micro_batches(batch, 400, "unpad", bucket=16, share_prefix=True)
    assert mb.prefix_len == SYSTEM and sorted(mb.rows) == list(range(6))
    own = sum(needed) - 6 * SYSTEM
    assert mb.input_ids_M_L.shape == (1, -(-own // 16) * 16)
    # Longest first; the padding follows the shortest row, as its piece's last tokens.
    tail = mb.input_ids_M_L.shape[1] - own
    lengths = [needed[b] - SYSTEM for b in mb.rows]
    assert lengths == sorted(lengths, reverse=True) and tail > 0
    assert mb.piece_lengths == (*lengths[:-1], lengths[-1] + tail)
    # Positions restart after the prefix in every piece and run on through the padding.
    starts = torch.tensor((0, *mb.piece_lengths)).cumsum(0)[:-1]
    assert torch.equal(mb.position_ids_M_L[0, starts], torch.full((6,), SYSTEM))
    assert int(mb.position_ids_M_L[0, -1]) == SYSTEM + lengths[-1] + tail - 1
    assert torch.equal(mb.input_ids_M_L[mb.target_m_N, mb.target_l_N], mb.take(batch.input_ids_B_T))
    covered = mb.source_N.sort().values
    assert torch.equal(covered, batch.loss_mask_B_T.reshape(-1).nonzero()[:, 0])
    # A budget for one group at a time: each pass covers its question too.
    mbs = micro_batches(batch, 140, "unpad", share_prefix=True)
    assert sorted(sorted(mb.rows) for mb in mbs) == [[0, 1, 2], [3, 4, 5]]
    assert [mb.prefix_len for mb in mbs] == [SYSTEM + QUESTION - 1] * 2
    assert all(mb.num_tokens <= 140 and int(mb.target_l_N.min()) >= 1 for mb in mbs)
    # Without share_prefix, rows are only put end to end.
    assert all(mb.prefix_len == 0 for mb in micro_batches(batch, 400, "unpad"))


def test_each_group_s_question_runs_once_as_a_stem_that_its_rows_continue() -> None:
    batch = agent_batch(vocab=1000, groups=3, per_group=4, question_len=LONG_QUESTION)
    needed = (batch.loss_mask_B_T.cumsum(1).argmax(1) + 1).tolist()
    stem = LONG_QUESTION - 1  # the question's last token scores the first reply token
    (mb,) = micro_batches(batch, 1000, "unpad", share_prefix=True)
    assert mb.prefix_len == SYSTEM and sorted(mb.rows) == list(range(12))
    # Per group: its stem, then its four rows' pieces; every piece after a stem continues it.
    assert mb.piece_stems == (-1, 0, 0, 0, 0, -1, 5, 5, 5, 5, -1, 10, 10, 10, 10)
    assert [mb.piece_lengths[i] for i in (0, 5, 10)] == [stem] * 3
    assert mb.num_tokens == SYSTEM + 3 * stem + sum(needed) - 12 * (SYSTEM + stem)
    starts = torch.tensor((0, *mb.piece_lengths)).cumsum(0)[:-1]
    for i, (start, parent) in enumerate(zip(starts.tolist(), mb.piece_stems, strict=True)):
        # Positions continue from the prefix, and after a stem from the stem's end.
        assert int(mb.position_ids_M_L[0, start]) == SYSTEM + (stem if parent >= 0 else 0), i
    for k, b in enumerate(mb.rows):  # a stem holds its group's question (all rows agree)
        group_stem = 5 * (k // 4)
        a = int(starts[group_stem])
        assert torch.equal(mb.input_ids_M_L[0, a:a + stem], batch.input_ids_B_T[b, SYSTEM:SYSTEM + stem])
    assert torch.equal(mb.input_ids_M_L[mb.target_m_N, mb.target_l_N], mb.take(batch.input_ids_B_T))
    assert torch.equal(mb.source_N.sort().values, batch.loss_mask_B_T.reshape(-1).nonzero()[:, 0])
    assert int(mb.target_l_N.min()) >= 1 and not any(
        int(s) <= int(t) < int(s) + stem for t in mb.target_l_N for s in starts[[0, 5, 10]])
    # Short questions make no stems, as without them.
    (short,) = micro_batches(agent_batch(vocab=1000, groups=3, per_group=4), 1000, "unpad",
                             share_prefix=True)
    assert short.piece_stems is None


def test_the_budget_counts_stems_so_whole_groups_fit_one_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    batch = agent_batch(vocab=1000, groups=2, per_group=3, question_len=LONG_QUESTION)
    needed = (batch.loss_mask_B_T.cumsum(1).argmax(1) + 1).tolist()
    stem = LONG_QUESTION - 1
    with_stems = SYSTEM + sum(needed) - 6 * SYSTEM - 2 * 2 * stem
    (mb,) = micro_batches(batch, with_stems, "unpad", share_prefix=True)
    assert mb.num_tokens == with_stems and mb.piece_stems is not None
    # Planned as if every row ran its question, the six rows would need two passes.
    monkeypatch.setattr(packing, "MIN_STEM", 1 << 30)
    assert len(micro_batches(batch, with_stems, "unpad", share_prefix=True)) == 2


def test_rows_share_stems_where_the_most_tokens_are_saved() -> None:
    base = torch.arange(200)

    def row(shared: int, tag: int) -> torch.Tensor:
        return torch.cat([base[:10 + shared], torch.full((20,), 1000 + tag)])

    first = [60] * 5
    # Three rows share 30 tokens after a 10-token prefix; a fourth shares only MIN_STEM - 1.
    rows = [row(30, 0), row(30, 1), row(30, 2), torch.cat([base[:10 + MIN_STEM - 1],
                                                          torch.full((40,), 7)])]
    assert plan_stems(rows, first, 10) == [([3], 0), ([0, 1, 2], 30)]  # in token order
    # A row sharing 12 with a run of three that share 30 runs alone (2 x 30 saved, not 3 x 12),
    # whether it sorts after them or before.
    assert plan_stems([*rows[:3], row(12, 3)], first, 10) == [([0, 1, 2], 30), ([3], 0)]
    before = torch.cat([base[:22], torch.zeros(30, dtype=torch.long)])
    assert plan_stems([*rows[:3], before], first, 10) == [([3], 0), ([0, 1, 2], 30)]
    # Two pairs that share 15 tokens: each pair's own stem (30 + 25 saved) beats one stem of
    # 15 for all four (3 x 15).
    pair = [torch.cat([base[:25], torch.full((10,), 500), torch.full((20,), k)]) for k in (1, 2)]
    assert plan_stems([row(30, 0), row(30, 1), *pair], first, 10) == [([0, 1], 30), ([2, 3], 25)]
    # A stem stops before the position that scores a row's first trained token.
    assert plan_stems(rows[:2], [25, 60], 10) == [([0, 1], 14)]
    assert plan_stems(rows[:2], [10 + MIN_STEM, 60], 10) == [([0], 0), ([1], 0)]


@pytest.mark.parametrize("packing,share,question,budget", [
    ("pad", True, QUESTION, 140), ("unpad", True, QUESTION, 140), ("unpad", False, QUESTION, 140),
    ("unpad", True, LONG_QUESTION, 400)], ids=["pad", "unpad", "unpad-unshared", "unpad-stems"])
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_shared_prefix_logprobs_gradients_and_step_equal_the_full_rows(
    model_fixture: str, packing: str, share: bool, question: int, budget: int,
    request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(model_fixture)
    # A large Adam epsilon: on gradients near 0 Adam's first step is sign(g) * lr, which would
    # turn float noise between two equal gradients into full-size differences.
    cfg = TrainConfig(micro_batch_tokens=budget, bf16=False, lr=1e-3, adam_eps=1e-3,
                      length_bucket=1, packing="pad", share_prefix=False)
    full = Actor(path, cfg)
    shared = Actor(path, TrainConfig(**{**cfg.__dict__, "packing": packing, "share_prefix": share}))
    batch = agent_batch(vocab=full.model.config.vocab_size, seed=2, question_len=question,
                        groups=3 if question == LONG_QUESTION else 2)
    if question == LONG_QUESTION:  # the last group's one row runs without a stem beside them
        batch = batch.select(range(7))
    assert all((mb.prefix_len > 0) == share for mb in shared.micro_batches(batch))
    # Stems only where a group's question is long enough to be worth one.
    assert all((mb.piece_stems is not None) == (question == LONG_QUESTION)
               for mb in shared.micro_batches(batch))
    assert all(mb.prefix_len == 0 and mb.piece_lengths is None for mb in full.micro_batches(batch))
    assert torch.allclose(shared.compute_logprobs(batch), full.compute_logprobs(batch), atol=1e-5)

    # A loss that weighs each token differently, by where it sits in the batch.
    weights_B_T = torch.linspace(-1, 1, batch.loss_mask_B_T.numel()).view_as(batch.loss_mask_B_T)
    grads = []
    for actor in (full, shared):
        for mb in actor.micro_batches(batch):
            (actor.token_logprobs(actor.model, mb) * mb.take(weights_B_T)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in actor.model.parameters()]))
        actor.model.zero_grad(set_to_none=True)
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-5

    adv_B_T = compute_advantages(batch, cfg).adv_B_T
    for actor in (full, shared):
        actor.update(batch, adv_B_T)
    for a, b in zip(full.model.parameters(), shared.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7), (a - b).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("question", [QUESTION, LONG_QUESTION], ids=["prefix", "stems"])
def test_compiled_layers_with_shared_prefixes_share_graphs_and_give_the_eager_gradients(
    tmp_path: Path, model_dir: str, monkeypatch: pytest.MonkeyPatch, question: int
) -> None:
    # Dynamo's graphs and guards are under test, not inductor's kernels (test_bf16_copy covers
    # those), so the layers compile with aot_eager.
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: compile_module(self, **{**kw, "backend": "aot_eager"}))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=1000, tie_word_embeddings=True,
                                 **{**TINY, "num_hidden_layers": 10})).save_pretrained(tmp_path)
    copy_tokenizer_files(model_dir, tmp_path)
    # With stems, a budget for both groups in one pass (one group a pass runs its question in
    # the prefix).
    cfg = TrainConfig(micro_batch_tokens=140 if question == QUESTION else 400, bf16=False,
                      length_bucket=1)
    batch = agent_batch(vocab=1000, seed=3, question_len=question)
    results = []
    for compile in (False, True):
        actor = Actor(str(tmp_path), TrainConfig(**{**cfg.__dict__, "compile": compile}))
        assert all(mb.prefix_len > 0 for mb in actor.micro_batches(batch))
        assert any(mb.piece_stems is not None for mb in actor.micro_batches(batch)) == (
            question == LONG_QUESTION)
        torch._dynamo.reset()
        # The layers share their graphs (a few per code object: one row or many, grad or not).
        # The prefix cache's layer index used to key them apart, a graph per layer, and past
        # dynamo's recompile limit the remaining layers ran eager, silently: here, past the
        # actor's limit of 32, 10 layers x 4 such graphs fail instead.
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            logprobs = actor.compute_logprobs(batch)
            for mb in actor.micro_batches(batch):
                actor.token_logprobs(actor.model, mb).sum().backward()
        results.append((logprobs, torch.cat([p.grad.flatten() for p in actor.model.parameters()])))
    (eager_logprobs, eager_grad), (logprobs, grad) = results
    assert torch.allclose(logprobs, eager_logprobs, atol=1e-5)
    assert float((grad - eager_grad).norm() / eager_grad.norm()) < 1e-5
