"""The policy loss: PPO's clipped surrogate with separate low/high clips, an off-policy correction
for tokens sampled by older weights, and an optional k3 KL to a reference model.

Three logprobs meet here. *Behaviour* logprobs were recorded by the engine that sampled the
token (maybe several versions ago, maybe in another precision). *Proximal* logprobs are the
current weights' logprobs before this batch's first update. *Current* logprobs carry the gradient.

- `decoupled` (decoupled PPO): the ratio `exp(logp - prox)` is clipped around the proximal
  policy, so the trust region is about recent weights, and the importance weight
  `exp(prox - behav)` corrects for the stale sampler; tokens whose weight exceeds
  `behav_weight_cap` (if set) are dropped as too far off-policy to trust.
- `tis` (truncated importance sampling): the same ratio, with the weight truncated at `tis_cap`
  instead (bias traded for bounded variance; no token is dropped).
- `none`: plain PPO with the behaviour logprobs as the old policy (no proximal pass needed).

Every function is shape-agnostic (`_B_T` in names, but the actor passes flat `_N` vectors of
the trained tokens); the loss is a weighted sum, with per-token weights from `token_weights`
computed once for the whole batch, so micro-batch losses add up to exactly the batch loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from relayrl.train.config import TrainConfig

_MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped to this before `exp`, so one wild token cannot make an inf."""

SUM_STATS = frozenset({"loss", "pg_loss", "kl_loss", "n_tokens", "sft_replay_loss"})
"""Stats that add across micro-batches; `*_max` / `*_min` take the max / min, others average."""


@dataclass(frozen=True)
class LossInputs:
    """Per-token tensors of one (micro-)batch, all of one shape."""

    prox_logprobs: torch.Tensor | None
    """Current weights before the update (None only with `off_policy="none"`)."""
    behav_logprobs: torch.Tensor
    """Recorded by the engine that sampled the token."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """True on trained tokens."""
    weights: torch.Tensor
    """Each token's share of the batch loss (`token_weights`); 0 off the mask."""
    ref_logprobs: torch.Tensor | None = None
    """Reference model, for the KL term (None when `kl_coef == 0`)."""


@dataclass(frozen=True)
class LossOutput:
    """The differentiable loss and float stats (token means over the mask, unless named)."""

    loss: torch.Tensor
    stats: dict[str, float]


def token_weights(mask_B_T: torch.Tensor, agg: str) -> torch.Tensor:
    """Each token's share of the loss, so that `(weights * per_token_loss).sum()` aggregates it.

    `token`: every trained token weighs the same (1 / all tokens). `seq-mean-token-mean`: each
    row weighs the same, split evenly over its tokens. `seq-mean-token-sum`: a row's tokens are
    summed, rows averaged (longer rows weigh more). Rows with no trained token do not count.
    """
    mask = mask_B_T.float()
    per_row_B = mask.sum(-1)
    rows = (per_row_B > 0).sum().clamp(min=1)
    if agg == "token":
        return mask / mask.sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        return mask / per_row_B.clamp(min=1)[:, None] / rows
    if agg == "seq-mean-token-sum":
        return mask / rows
    raise ValueError(f"unknown loss aggregation {agg!r}")


def importance_weights(
    prox_B_T: torch.Tensor,
    behav_B_T: torch.Tensor,
    off_policy: str,
    tis_cap: float,
    behav_weight_cap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, keep, capped): `exp(prox - behav)` shaped by the off-policy mode; no gradient.

    `keep` is False on tokens `decoupled` drops; `capped` marks tokens a cap changed.
    """
    raw = torch.exp((prox_B_T - behav_B_T).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)).detach()
    every = torch.ones_like(raw, dtype=torch.bool)
    if off_policy == "none":
        return torch.ones_like(raw), every, ~every
    if off_policy == "tis":
        return raw.clamp(max=tis_cap), every, raw > tis_cap
    if off_policy == "decoupled":
        if behav_weight_cap is None:
            return raw, every, ~every
        keep = raw <= behav_weight_cap
        return raw, keep, ~keep
    raise ValueError(f"unknown off-policy correction {off_policy!r}")


def clipped_surrogate(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    adv_B_T: torch.Tensor,
    eps_clip_low: float,
    eps_clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, ratio, clipped below, clipped above) of `-min(r A, clip(r) A)`.

    `clipped below` marks tokens where the clip removed the gradient because the ratio fell
    under `1 - eps_clip_low` with A < 0; `clipped above`: over `1 + eps_clip_high` with A > 0.
    """
    log_ratio = (logprobs_B_T - old_logprobs_B_T).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    loss = torch.maximum(-ratio * adv_B_T, -clipped * adv_B_T)
    below = (adv_B_T < 0) & (ratio < 1.0 - eps_clip_low)
    above = (adv_B_T > 0) & (ratio > 1.0 + eps_clip_high)
    return loss, ratio, below, above


def k3_kl(logprobs_B_T: torch.Tensor, ref_logprobs_B_T: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(current || reference): `exp(d) - d - 1`, `d = ref - logp`."""
    d = (ref_logprobs_B_T - logprobs_B_T).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


def ppo_loss(logprobs_B_T: torch.Tensor, inputs: LossInputs, cfg: TrainConfig) -> LossOutput:
    """The weighted PPO loss of these tokens (their share of the batch loss) and its stats."""
    if cfg.off_policy == "none":
        old = inputs.behav_logprobs
        weight, keep, capped = importance_weights(old, old, "none", cfg.tis_cap, None)
    else:
        if inputs.prox_logprobs is None:
            raise ValueError(f"off_policy={cfg.off_policy!r} needs proximal logprobs")
        old = inputs.prox_logprobs
        weight, keep, capped = importance_weights(
            old, inputs.behav_logprobs, cfg.off_policy, cfg.tis_cap, cfg.behav_weight_cap
        )
    surrogate, ratio, below, above = clipped_surrogate(
        logprobs_B_T, old.detach(), inputs.advantages, cfg.eps_clip_low, cfg.eps_clip_high
    )
    token_share = inputs.weights * keep
    pg_loss = (token_share * weight * surrogate).sum()
    kl_loss = torch.zeros(())
    ref_kl = None
    if inputs.ref_logprobs is not None and cfg.kl_coef > 0:
        ref_kl = k3_kl(logprobs_B_T, inputs.ref_logprobs.detach())
        kl_loss = cfg.kl_coef * (token_share * ref_kl).sum()
    loss = pg_loss + kl_loss
    stats = _loss_stats(logprobs_B_T, old, inputs, ratio, weight, capped, below, above, ref_kl)
    stats.update(loss=float(loss.detach()), pg_loss=float(pg_loss.detach()),
                 kl_loss=float(kl_loss.detach()))
    return LossOutput(loss=loss, stats=stats)


def _loss_stats(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    inputs: LossInputs,
    ratio: torch.Tensor,
    weight: torch.Tensor,
    capped: torch.Tensor,
    below: torch.Tensor,
    above: torch.Tensor,
    ref_kl: torch.Tensor | None,
) -> dict[str, float]:
    mask = inputs.mask.bool()
    n = int(mask.sum())
    if n == 0:
        return {"n_tokens": 0.0}

    def mean(x: torch.Tensor) -> float:
        return float(x.detach().float()[mask].mean())

    stats = {
        "n_tokens": float(n),
        "clip_frac": mean((below | above).float()),
        "clip_low_frac": mean(below.float()),
        "clip_high_frac": mean(above.float()),
        "ratio_mean": mean(ratio),
        "ratio_max": float(ratio.detach()[mask].max()),
        "ratio_min": float(ratio.detach()[mask].min()),
        "approx_kl": mean(k3_kl(logprobs, old)),
        "is_weight_mean": mean(weight),
        "is_weight_max": float(weight[mask].max()),
        "is_weight_min": float(weight[mask].min()),
        "is_capped_frac": mean(capped.float()),
        "advantage_mean": mean(inputs.advantages),
        "logprob_mean": mean(logprobs),
    }
    if inputs.prox_logprobs is not None:
        # How far the sampler's logprobs are from ours: staleness plus engine/trainer mismatch.
        stats["behav_kl"] = mean(k3_kl(inputs.prox_logprobs, inputs.behav_logprobs))
    if ref_kl is not None:
        stats["ref_kl"] = mean(ref_kl)
    return stats


def merge_stats(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    """Combine micro-batch stats: sums add, `*_max`/`*_min` reduce, the rest token-average."""
    parts = [p for p in parts if p.get("n_tokens", 0) > 0]
    if not parts:
        return {"n_tokens": 0.0}
    total = sum(p["n_tokens"] for p in parts)
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        have = [p for p in parts if key in p]
        if key in SUM_STATS:
            out[key] = sum(p[key] for p in have)
        elif key.endswith("_max"):
            out[key] = max(p[key] for p in have)
        elif key.endswith("_min"):
            out[key] = min(p[key] for p in have)
        else:
            weight = sum(p["n_tokens"] for p in have)
            out[key] = sum(p[key] * p["n_tokens"] for p in have) / (weight or total)
    return out
