"""The sampling math: logprob definition, truncation sets, distributions, per-row generators."""

from __future__ import annotations

import pytest
import torch

from relayrl.engine.sampling import RowParams, sample


def shared(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draws(logits_V: torch.Tensor, row: RowParams, n: int, seed: int = 0) -> list[int]:
    """n independent samples of one row (the row repeated n times in one batch)."""
    return sample(logits_V.expand(n, -1), [row] * n, shared(seed)).token_ids


def test_greedy_picks_the_argmax_with_its_untempered_logprob() -> None:
    logits = torch.randn(3, 50, generator=shared(1)) * 3
    out = sample(logits, [RowParams(0.0)] * 3, shared())
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_logprobs_are_temperature_scaled_and_taken_before_truncation() -> None:
    logits = torch.randn(1, 200, generator=shared(2)) * 2
    row = RowParams(0.7, top_p=0.8, top_k=20)
    out = sample(logits.expand(64, -1), [row] * 64, shared())
    full = torch.log_softmax(logits[0] / 0.7, -1)
    assert out.logprobs == pytest.approx(full[out.token_ids].tolist(), abs=1e-6)


def test_bf16_logits_give_fp32_logprobs() -> None:
    logits = (torch.randn(2, 100, generator=shared(3)) * 4).bfloat16()
    out = sample(logits, [RowParams(0.0)] * 2, shared())
    expected = torch.log_softmax(logits.float(), -1).max(-1).values
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_top_k_one_is_greedy_even_when_sampling() -> None:
    logits = torch.randn(100, generator=shared(4))
    assert set(draws(logits, RowParams(1.5, top_k=1), 200)) == {int(logits.argmax())}


def test_top_k_draws_only_the_k_most_likely_tokens() -> None:
    logits = torch.randn(300, generator=shared(5))
    allowed = set(logits.topk(5).indices.tolist())
    got = draws(logits, RowParams(1.0, top_k=5), 500)
    assert set(got) <= allowed and len(set(got)) > 1


def nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """Reference nucleus: most likely tokens until their mass reaches top_p."""
    probs, ids = torch.softmax(logits.double(), -1).sort(descending=True)
    before = probs.cumsum(-1) - probs
    return set(ids[before < top_p].tolist())


@pytest.mark.parametrize(
    ("spread", "sizes"),
    [(0.3, range(2, 64)), (0.003, range(65, 1024)), (0.0001, range(1025, 5000))],
)
def test_top_p_draws_stay_in_the_exact_nucleus_however_large_it_is(
    spread: float, sizes: range
) -> None:
    # The three nucleus sizes fall within the first probe, the second, and past both.
    logits = -torch.arange(5000, dtype=torch.float32) * spread
    allowed = nucleus(logits, 0.5)
    got = draws(logits, RowParams(1.0, top_p=0.5), 400)
    assert len(allowed) in sizes
    assert set(got) <= allowed and len(set(got)) > 1


def test_untruncated_draws_follow_the_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    probs = torch.softmax(logits / 0.9, -1)
    n = 8000
    counts = torch.bincount(torch.tensor(draws(logits, RowParams(0.9), n)), minlength=4)
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 4 * sigma).all()


def test_top_p_draws_follow_the_renormalised_nucleus() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    probs = torch.softmax(logits, -1)
    kept = probs[:2] / probs[:2].sum()  # mass before token 2 is 0.9 > top_p=0.8
    n = 8000
    counts = torch.bincount(torch.tensor(draws(logits, RowParams(1.0, top_p=0.8), n)), minlength=5)
    assert counts[2:].sum() == 0
    sigma = (kept * (1 - kept) / n).sqrt()
    assert ((counts[:2] / n - kept).abs() <= 4 * sigma).all()


def test_tokens_without_probability_are_never_drawn() -> None:
    logits = torch.full((50,), float("-inf"))
    logits[[7, 31]] = torch.tensor([0.0, 0.5])
    for row in (RowParams(1.0), RowParams(1.0, top_p=0.99), RowParams(2.0, top_k=10)):
        assert set(draws(logits, row, 300)) <= {7, 31}


def test_a_seeded_row_draws_the_same_tokens_whatever_its_batch_mates() -> None:
    logits = torch.randn(4, 64, generator=shared(6))

    def run(batch: list[int], position: int, mates_seed: int) -> list[int]:
        seeded = torch.Generator().manual_seed(99)
        picked = []
        for _ in range(20):
            rows = [RowParams(1.0) for _ in batch]
            rows[position] = RowParams(1.0, top_p=0.9, generator=seeded)
            picked.append(sample(logits[batch], rows, shared(mates_seed)).token_ids[position])
            mates_seed += 1
        return picked

    alone = run([0], 0, 0)
    assert run([2, 0, 3], 1, 10) == alone
    assert run([1, 3, 2, 0], 3, 20) == alone


def test_top_logprobs_are_the_most_likely_tokens_in_order() -> None:
    logits = torch.randn(2, 80, generator=shared(7))
    out = sample(logits, [RowParams(0.0, top_logprobs=4), RowParams(0.5, top_logprobs=0)], shared())
    ids, lps = zip(*out.top_logprobs[0], strict=True)
    ref = torch.log_softmax(logits[0], -1).topk(4)
    assert list(ids) == ref.indices.tolist()
    assert list(lps) == pytest.approx(ref.values.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == []
