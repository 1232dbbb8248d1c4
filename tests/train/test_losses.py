"""The PPO loss against hand computations: clips on both sides, off-policy weights, KL, and
token- vs sequence-level aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.train.config import TrainConfig
from relayrl.train.losses import (
    LossInputs,
    clipped_surrogate,
    importance_weights,
    k3_kl,
    merge_stats,
    ppo_loss,
    token_weights,
)

T = torch.tensor
LN = math.log


def inputs(logp_old: list[float], adv: list[float], behav: list[float] | None = None,
           ref: list[float] | None = None) -> LossInputs:
    """One row of tokens, all trained, token-mean weights."""
    mask = torch.ones(len(adv), dtype=torch.bool)
    return LossInputs(
        prox_logprobs=T(logp_old),
        behav_logprobs=T(logp_old if behav is None else behav),
        advantages=T(adv),
        mask=mask,
        weights=token_weights(mask, "token"),
        ref_logprobs=None if ref is None else T(ref),
    )


def loss_and_grad(
    logp: list[float], inp: LossInputs, cfg: TrainConfig
) -> tuple[float, list[float], dict[str, float]]:
    x = T(logp, requires_grad=True)
    out = ppo_loss(x, inp, cfg)
    out.loss.backward()
    assert x.grad is not None
    return float(out.loss.detach()), x.grad.tolist(), out.stats


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad", "low", "high"),
    [
        # inside [1 - 0.2, 1 + 0.28]: plain surrogate, gradient -r A
        (1.1, 1.0, -1.1, -1.1, False, False),
        (0.9, -1.0, 0.9, 0.9, False, False),
        # above 1.28 with A > 0: the clip holds the objective at 1.28 A, no gradient
        (1.5, 1.0, -1.28, 0.0, False, True),
        # above 1.28 with A < 0: the unclipped (worse) term wins, the gradient flows
        (1.5, -1.0, 1.5, 1.5, False, False),
        # below 0.8 with A < 0: held at 0.8 |A|, no gradient
        (0.5, -1.0, 0.8, 0.0, True, False),
        # below 0.8 with A > 0: unclipped, gradient flows
        (0.5, 2.0, -1.0, -1.0, False, False),
    ],
)
def test_clip_is_active_only_where_it_limits_the_improvement(
    ratio: float, adv: float, loss: float, grad: float, low: bool, high: bool
) -> None:
    cfg = TrainConfig(eps_clip_low=0.2, eps_clip_high=0.28, off_policy="decoupled")
    value, g, stats = loss_and_grad([LN(ratio) - 1.0], inputs([-1.0], [adv]), cfg)
    assert value == pytest.approx(loss, abs=1e-6)
    assert g[0] == pytest.approx(grad, abs=1e-6)
    assert stats["clip_low_frac"] == float(low)
    assert stats["clip_high_frac"] == float(high)
    _, _, below, above = clipped_surrogate(T([LN(ratio)]), T([0.0]), T([adv]), 0.2, 0.28)
    assert bool(below[0]) == low and bool(above[0]) == high


def test_decoupled_weight_is_prox_over_behaviour_and_scales_the_gradient() -> None:
    # prox - behav = ln 2: w = 2. logp = prox: r = 1. Loss per token = -w r A = -2 A.
    cfg = TrainConfig(off_policy="decoupled")
    inp = inputs([-1.0, -2.0], [1.0, -0.5], behav=[-1.0 - LN(2), -2.0 - LN(2)])
    value, grad, stats = loss_and_grad([-1.0, -2.0], inp, cfg)
    assert value == pytest.approx((-2.0 * 1.0 + -2.0 * -0.5) / 2, abs=1e-6)
    assert grad == pytest.approx([-2.0 * 1.0 / 2, -2.0 * -0.5 / 2], abs=1e-6)
    assert stats["is_weight_mean"] == pytest.approx(2.0)
    assert stats["behav_kl"] == pytest.approx(k3_kl(T(0.0), T(-LN(2))).item())


def test_decoupled_drops_tokens_whose_weight_exceeds_the_cap() -> None:
    # weights 3 and 1: with cap 2.5 the first token is dropped, the second keeps weight 1.
    cfg = TrainConfig(off_policy="decoupled", behav_weight_cap=2.5)
    inp = inputs([-1.0, -1.0], [1.0, 1.0], behav=[-1.0 - LN(3), -1.0])
    value, grad, stats = loss_and_grad([-1.0, -1.0], inp, cfg)
    assert value == pytest.approx(-1.0 / 2)
    assert grad == pytest.approx([0.0, -0.5])
    assert stats["is_capped_frac"] == 0.5


def test_tis_truncates_weights_at_the_cap_instead_of_dropping() -> None:
    cfg = TrainConfig(off_policy="tis", tis_cap=2.0)
    inp = inputs([-1.0, -1.0], [1.0, 1.0], behav=[-1.0 - LN(3), -1.0 - LN(1.5)])
    value, grad, stats = loss_and_grad([-1.0, -1.0], inp, cfg)
    assert value == pytest.approx((-2.0 - 1.5) / 2)
    assert grad == pytest.approx([-1.0, -0.75])
    assert stats["is_capped_frac"] == 0.5
    assert stats["is_weight_max"] == pytest.approx(2.0)
    weight, keep, capped = importance_weights(T([0.0]), T([-LN(3)]), "tis", 2.0, None)
    assert weight.item() == pytest.approx(2.0) and keep.all() and capped.all()


def test_without_correction_the_ratio_is_taken_against_the_behaviour_logprobs() -> None:
    # off_policy=none: r = exp(logp - behav) = 1.1 (prox is ignored).
    cfg = TrainConfig(off_policy="none")
    inp = inputs([-5.0], [1.0], behav=[-1.0])
    value, grad, _ = loss_and_grad([-1.0 + LN(1.1)], inp, cfg)
    assert value == pytest.approx(-1.1)
    assert grad == pytest.approx([-1.1])


def test_k3_kl_to_the_reference_is_added_with_its_coefficient() -> None:
    # ref - logp = ln 2: k3 = 2 - ln 2 - 1 = 0.306853; d k3 / d logp = 1 - e^d = -1
    cfg = TrainConfig(off_policy="decoupled", kl_coef=0.1)
    inp = inputs([-1.0], [0.0], ref=[-1.0 + LN(2)])
    value, grad, stats = loss_and_grad([-1.0], inp, cfg)
    assert stats["ref_kl"] == pytest.approx(2 - LN(2) - 1)
    assert value == pytest.approx(0.1 * (2 - LN(2) - 1))
    assert grad == pytest.approx([0.1 * -1.0])


def test_token_and_sequence_aggregation_weigh_rows_differently() -> None:
    # Row 0 trains 1 token, row 1 trains 3. Per-token losses 4, 1, 2, 3.
    mask = T([[0, 1, 0, 0], [0, 1, 1, 1]]).bool()
    per_token = T([[0.0, 4.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0]])

    def agg(kind: str) -> float:
        return float((token_weights(mask, kind) * per_token).sum())

    assert agg("token") == pytest.approx((4 + 1 + 2 + 3) / 4)
    assert agg("seq-mean-token-mean") == pytest.approx((4 / 1 + (1 + 2 + 3) / 3) / 2)
    assert agg("seq-mean-token-sum") == pytest.approx((4 + (1 + 2 + 3)) / 2)


def test_rows_without_trained_tokens_do_not_dilute_sequence_means() -> None:
    mask = T([[0, 1, 1], [0, 0, 0]]).bool()
    assert token_weights(mask, "seq-mean-token-mean")[0].tolist() == [0.0, 0.5, 0.5]


def test_micro_batch_losses_and_stats_add_up_to_the_whole_batch() -> None:
    cfg = TrainConfig(off_policy="tis", tis_cap=1.5)
    mask = T([[0, 1, 1, 0], [0, 1, 1, 1]]).bool()
    weights = token_weights(mask, "seq-mean-token-mean")
    logp = T([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -1.5, -0.2]])
    prox = logp - T([[0.0, 0.1, -0.3, 0.0], [0.0, 0.4, 0.0, -0.1]])
    behav = prox - 0.2
    adv = T([[0.0, 1.0, 1.0, 0.0], [0.0, -1.0, -1.0, -1.0]])

    def part(rows: slice) -> dict[str, float]:
        m = mask[rows]
        inp = LossInputs(prox[rows][m], behav[rows][m], adv[rows][m], m[m], weights[rows][m])
        return ppo_loss(logp[rows][m], inp, cfg).stats

    whole = part(slice(0, 2))
    merged = merge_stats([part(slice(0, 1)), part(slice(1, 2))])
    for key in ("loss", "n_tokens", "clip_frac", "ratio_max", "is_weight_min", "approx_kl"):
        assert merged[key] == pytest.approx(whole[key], abs=1e-6), key
