"""Advantages: rewards centred (and scaled) within a group of episodes that share a prompt.

A group is the episodes sampled for one data item; an episode may leave several rows (one per
segment) and many turns. Statistics are taken over *episodes*, each counted once, and every row
or turn of an episode inherits its advantage: an agent that took ten turns does not weigh ten
times as much in the baseline as one that took a single turn.

All functions are pure tensor functions; ids are integer tensors (`label_index` turns string ids
into them). The std is the unbiased one (divisor n - 1), as in GRPO and TRL; a group of one
episode gets advantage 0. A uniform group (every episode one reward) has advantage 0 under its
own mean and is dropped (`drop_uniform_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from relayrl.errors import InvalidRequest

if TYPE_CHECKING:
    from relayrl.train.config import TrainConfig
    from relayrl.train.packing import TrainBatch


def label_index(labels: Sequence[str]) -> torch.Tensor:
    """Dense integer ids (0, 1, ...) for string labels, in order of first appearance."""
    seen: dict[str, int] = {}
    return torch.tensor([seen.setdefault(x, len(seen)) for x in labels], dtype=torch.long)


def group_advantages(
    rewards_G: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages of one group: `r - mean(r)`, divided by `std(r) + eps` when `normalize_std`."""
    group_ids_G = torch.zeros(rewards_G.shape[0], dtype=torch.long)
    return episode_advantages(rewards_G, group_ids_G, normalize_std, eps)


def episode_advantages(
    rewards_E: torch.Tensor,
    group_ids_E: torch.Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-episode advantages, normalized within each group (one reward per episode)."""
    weights_E = torch.ones_like(rewards_E, dtype=torch.float32)
    return _normalize_in_groups(rewards_E.float(), group_ids_E, weights_E, normalize_std, eps)


def turn_advantages(
    returns_K: torch.Tensor,
    episode_ids_K: torch.Tensor,
    group_ids_K: torch.Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-turn advantages from per-turn returns, each episode weighing 1 in its group's stats.

    A turn of an episode with n turns gets weight 1/n in the group mean and variance, so the
    baseline is the mean over episodes of each episode's mean return. With one turn per episode
    this equals `episode_advantages`.
    """
    _, inverse_K, counts = torch.unique(episode_ids_K, return_inverse=True, return_counts=True)
    weights_K = 1.0 / counts[inverse_K].float()
    return _normalize_in_groups(returns_K.float(), group_ids_K, weights_K, normalize_std, eps)


def _normalize_in_groups(
    values_N: torch.Tensor,
    group_ids_N: torch.Tensor,
    weights_N: torch.Tensor,
    normalize_std: bool,
    eps: float,
) -> torch.Tensor:
    """Weighted centring (and scaling) within groups; weights count episodes (sum = episodes)."""
    _, inverse_N = torch.unique(group_ids_N, return_inverse=True)
    n_groups = int(inverse_N.max().item()) + 1 if inverse_N.numel() else 0
    mass_G = torch.zeros(n_groups).index_add_(0, inverse_N, weights_N)
    mean_G = torch.zeros(n_groups).index_add_(0, inverse_N, weights_N * values_N) / mass_G
    centred_N = values_N - mean_G[inverse_N]
    if not normalize_std:
        return centred_N
    sq_G = torch.zeros(n_groups).index_add_(0, inverse_N, weights_N * centred_N**2)
    # Unbiased: divide by (episodes - 1); a lone episode has no spread and gets 0 below.
    std_G = (sq_G / (mass_G - 1).clamp(min=1e-12)).sqrt()
    alone_N = (mass_G <= 1 + 1e-6)[inverse_N]
    advantages_N = centred_N / (std_G[inverse_N] + eps)
    return torch.where(alone_N, torch.zeros_like(advantages_N), advantages_N)


def uniform_groups(
    values_N: torch.Tensor, group_ids_N: torch.Tensor, tol: float = 1e-6
) -> torch.Tensor:
    """True where an item's group holds one value only (max - min <= tol): no learning signal."""
    _, inverse_N = torch.unique(group_ids_N, return_inverse=True)
    n_groups = int(inverse_N.max().item()) + 1 if inverse_N.numel() else 0
    values_N = values_N.float()
    hi_G = torch.full((n_groups,), -torch.inf).scatter_reduce(0, inverse_N, values_N, "amax")
    lo_G = torch.full((n_groups,), torch.inf).scatter_reduce(0, inverse_N, values_N, "amin")
    return (hi_G - lo_G <= tol)[inverse_N]


def episode_rewards(
    rewards_B: torch.Tensor, episode_ids_B: torch.Tensor, group_ids_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse rows to episodes: (rewards_E, group_ids_E, episode_of_row_B).

    An episode's reward is the mean of its rows' rewards (equal under outcome credit); its group
    is its first row's group.
    """
    _, row_to_ep_B = torch.unique(episode_ids_B, return_inverse=True)
    n = int(row_to_ep_B.max().item()) + 1 if row_to_ep_B.numel() else 0
    count_E = torch.zeros(n).index_add_(0, row_to_ep_B, torch.ones(row_to_ep_B.shape[0]))
    rewards_E = torch.zeros(n).index_add_(0, row_to_ep_B, rewards_B.float()) / count_E
    first_row_E = torch.full((n,), rewards_B.shape[0], dtype=torch.long).scatter_reduce(
        0, row_to_ep_B, torch.arange(rewards_B.shape[0]), "amin"
    )
    return rewards_E, group_ids_B[first_row_E], row_to_ep_B


def row_advantages(
    rewards_B: torch.Tensor,
    episode_ids_B: torch.Tensor,
    group_ids_B: torch.Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Each row gets its episode's group-normalized advantage (episodes counted once)."""
    rewards_E, group_ids_E, row_to_ep_B = episode_rewards(rewards_B, episode_ids_B, group_ids_B)
    return episode_advantages(rewards_E, group_ids_E, normalize_std, eps)[row_to_ep_B]


def uniform_rows(
    rewards_B: torch.Tensor, episode_ids_B: torch.Tensor, group_ids_B: torch.Tensor
) -> torch.Tensor:
    """True on rows whose group's episodes all got the same reward."""
    rewards_E, group_ids_E, row_to_ep_B = episode_rewards(rewards_B, episode_ids_B, group_ids_B)
    return uniform_groups(rewards_E, group_ids_E)[row_to_ep_B]


def broadcast_to_tokens(values_B: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """A per-row value on every masked token of its row (0 elsewhere)."""
    return values_B.float()[:, None] * mask_B_T.float()


def spans_to_tokens(
    values_K: torch.Tensor,
    row_K: torch.Tensor,
    spans_K_2: torch.Tensor,
    mask_B_T: torch.Tensor,
) -> torch.Tensor:
    """Per-turn values written over their `[start, end)` token spans, kept on masked tokens only."""
    out_B_T = torch.zeros(mask_B_T.shape, dtype=torch.float32)
    for k in range(values_K.shape[0]):  # bounded by the number of turns in the batch
        start, end = int(spans_K_2[k, 0]), int(spans_K_2[k, 1])
        out_B_T[int(row_K[k]), start:end] = values_K[k].float()
    return out_B_T * mask_B_T.float()


@dataclass(frozen=True)
class Advantages:
    """A batch's per-token advantages, and the batch with uniform groups dropped from its mask."""

    batch: TrainBatch
    """The input batch; its loss mask no longer covers dropped groups."""
    adv_B_T: torch.Tensor
    stats: dict[str, float]


def compute_advantages(batch: TrainBatch, cfg: TrainConfig) -> Advantages:
    """Advantages per `cfg.advantage_source` ("group": episode rewards; "turn": turn returns)."""
    episode_B = label_index(batch.episode_ids)
    group_B = label_index(batch.group_ids)
    normalize = cfg.adv_norm == "std"
    mask_B_T = batch.loss_mask_B_T
    if cfg.advantage_source == "group":
        adv_B = row_advantages(batch.rewards_B, episode_B, group_B, normalize)
        drop_B = uniform_rows(batch.rewards_B, episode_B, group_B)
        adv_B_T = broadcast_to_tokens(adv_B, mask_B_T)
    else:
        adv_B_T, drop_B = _turn_token_advantages(batch, episode_B, group_B, normalize)
    if cfg.drop_uniform_groups:
        mask_B_T = mask_B_T & ~drop_B[:, None]
        adv_B_T = adv_B_T * mask_B_T
    rewards_E, group_E, _ = episode_rewards(batch.rewards_B, episode_B, group_B)
    trained = mask_B_T.float()
    stats = {
        "reward_mean": float(rewards_E.mean()),
        "reward_std": float(rewards_E.std(unbiased=False)),
        "episodes": float(rewards_E.shape[0]),
        "groups": float(torch.unique(group_E).numel()),
        "uniform_group_frac": float(uniform_groups(rewards_E, group_E).float().mean()),
        "dropped_row_frac": float(drop_B.float().mean()) if cfg.drop_uniform_groups else 0.0,
        "adv_abs_mean": float((adv_B_T.abs() * trained).sum() / trained.sum().clamp(min=1)),
        "trained_tokens": float(trained.sum()),
    }
    return Advantages(batch=replace(batch, loss_mask_B_T=mask_B_T), adv_B_T=adv_B_T, stats=stats)


def _turn_token_advantages(
    batch: TrainBatch, episode_B: torch.Tensor, group_B: torch.Tensor, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if batch.turn_spans is None or batch.turn_rewards is None:
        raise InvalidRequest("advantage_source='turn' needs per-turn spans and returns: build the "
                             "batch with TrainBatch.from_rows")
    row_K = torch.tensor([b for b, spans in enumerate(batch.turn_spans) for _ in spans],
                         dtype=torch.long)
    spans_K_2 = torch.tensor([s for spans in batch.turn_spans for s in spans],
                             dtype=torch.long).reshape(-1, 2)
    returns_K = torch.tensor([r for rs in batch.turn_rewards for r in rs], dtype=torch.float32)
    if returns_K.shape[0] != row_K.shape[0]:
        raise InvalidRequest(f"{row_K.shape[0]} turn spans but {returns_K.shape[0]} turn returns")
    adv_K = turn_advantages(returns_K, episode_B[row_K], group_B[row_K], normalize)
    uniform_K = uniform_groups(returns_K, group_B[row_K])
    # A row's turns share its group: drop the row when that group's turn returns are all equal,
    # and drop rows with no turns at all (nothing to credit).
    drop_B = torch.ones(batch.num_rows, dtype=torch.bool).index_put_((row_K,), uniform_K)
    adv_B_T = spans_to_tokens(adv_K, row_K, spans_K_2, batch.loss_mask_B_T)
    return adv_B_T, drop_B
