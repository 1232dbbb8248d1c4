"""Advantages against hand computations: group normalization, episodes counted once, turn credit."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.errors import InvalidRequest
from relayrl.train.advantages import (
    compute_advantages,
    episode_advantages,
    group_advantages,
    label_index,
    row_advantages,
    spans_to_tokens,
    turn_advantages,
    uniform_groups,
)
from relayrl.train.config import TrainConfig
from relayrl.train.packing import TrainBatch

T = torch.tensor


def test_group_advantages_centre_and_divide_by_unbiased_std() -> None:
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.57735
    adv = group_advantages(T([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    assert torch.allclose(adv, T([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5)
    centred = group_advantages(T([3.0, 1.0, 2.0]), normalize_std=False)
    assert torch.allclose(centred, T([1.0, -1.0, 0.0]))


def test_a_uniform_group_and_a_lone_episode_get_zero_advantage() -> None:
    assert torch.equal(group_advantages(T([0.7, 0.7, 0.7])), torch.zeros(3))
    assert torch.equal(group_advantages(T([5.0])), torch.zeros(1))


def test_episode_advantages_normalize_within_each_group_only() -> None:
    rewards = T([1.0, 0.0, 10.0, 20.0, 30.0])
    groups = T([0, 0, 1, 1, 1])
    adv = episode_advantages(rewards, groups, eps=0.0)
    # group 0: mean .5, std .7071 -> +-.7071; group 1: mean 20, std 10 -> -1, 0, 1
    assert torch.allclose(adv, T([0.707107, -0.707107, -1.0, 0.0, 1.0]), atol=1e-5)


def test_an_episode_with_many_rows_counts_once_in_its_group() -> None:
    # Episode 0 left three rows (reward 1), episode 1 one row (reward 0), one group.
    # Per episode: mean 0.5, std 0.7071. Per row (wrong) the mean would be 0.75.
    rewards_B = T([1.0, 1.0, 1.0, 0.0])
    episodes_B = label_index(["e0", "e0", "e0", "e1"])
    groups_B = label_index(["g", "g", "g", "g"])
    adv = row_advantages(rewards_B, episodes_B, groups_B, eps=0.0)
    assert torch.allclose(adv, T([0.707107, 0.707107, 0.707107, -0.707107]), atol=1e-5)


def test_turn_advantages_weigh_each_episode_once_whatever_its_turns() -> None:
    # Episode A: turns returning 1.0 and 0.5; episode B: one turn returning 0. Same group.
    # Weights: A's turns 1/2 each, B's 1. Mean = (.5 + .25 + 0) / 2 = .375.
    # Sum of w * dev^2 = .5 * .625^2 + .5 * .125^2 + .375^2 = .34375; / (2 - 1) -> std .586302
    returns = T([1.0, 0.5, 0.0])
    adv = turn_advantages(returns, T([0, 0, 1]), T([0, 0, 0]), eps=0.0)
    std = math.sqrt(0.34375)
    assert torch.allclose(adv, T([0.625 / std, 0.125 / std, -0.375 / std]), atol=1e-5)
    centred = turn_advantages(returns, T([0, 0, 1]), T([0, 0, 0]), normalize_std=False)
    assert torch.allclose(centred, T([0.625, 0.125, -0.375]))


def test_turn_advantages_with_one_turn_per_episode_equal_episode_advantages() -> None:
    rewards = T([0.2, 0.9, 0.4, 1.0, 3.0])
    groups = T([0, 0, 0, 1, 1])
    assert torch.allclose(turn_advantages(rewards, torch.arange(5), groups),
                          episode_advantages(rewards, groups))


def test_uniform_groups_mark_every_member_of_a_one_valued_group() -> None:
    flags = uniform_groups(T([1.0, 1.0, 0.0, 1.0, 0.3]), T([0, 0, 1, 1, 2]))
    assert flags.tolist() == [True, True, False, False, True]


def test_spans_to_tokens_fills_turn_spans_and_keeps_only_masked_tokens() -> None:
    mask = T([[0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 0, 0]]).bool()
    out = spans_to_tokens(T([0.5, -1.0, 2.0]), T([0, 0, 1]), T([[1, 3], [4, 6], [2, 4]]), mask)
    assert out.tolist() == [[0, 0.5, 0.5, 0, -1.0, -1.0], [0, 0, 2.0, 2.0, 0, 0]]


def batch_of(rewards: list[float], episodes: list[str], groups: list[str],
             spans: list[list[tuple[int, int]]] | None = None,
             turn_rewards: list[list[float]] | None = None) -> TrainBatch:
    """Rows of 4 tokens: a prompt token, then 3 trained tokens."""
    b = len(rewards)
    mask = T([[0, 1, 1, 1]] * b).bool()
    return TrainBatch(
        input_ids_B_T=torch.arange(4).repeat(b, 1),
        attention_mask_B_T=torch.ones(b, 4, dtype=torch.bool),
        loss_mask_B_T=mask,
        behav_logprobs_B_T=torch.zeros(b, 4),
        versions_B_T=torch.zeros(b, 4, dtype=torch.long),
        rewards_B=T(rewards),
        episode_ids=tuple(episodes),
        group_ids=tuple(groups),
        turn_spans=None if spans is None else tuple(tuple(s) for s in spans),
        turn_rewards=None if turn_rewards is None else tuple(tuple(r) for r in turn_rewards),
    )


def test_compute_advantages_drops_uniform_groups_from_the_loss_mask() -> None:
    batch = batch_of([1.0, 0.0, 1.0, 1.0], ["a", "b", "c", "d"], ["g1", "g1", "g2", "g2"])
    out = compute_advantages(batch, TrainConfig(drop_uniform_groups=True))
    assert torch.equal(out.batch.loss_mask_B_T[:2], batch.loss_mask_B_T[:2])
    assert not out.batch.loss_mask_B_T[2:].any()
    assert torch.allclose(out.adv_B_T[0], T([0, 0.707106, 0.707106, 0.707106]), atol=1e-5)
    assert out.stats["uniform_group_frac"] == 0.5
    assert out.stats["reward_mean"] == 0.75
    kept = compute_advantages(batch, TrainConfig(drop_uniform_groups=False))
    assert torch.equal(kept.batch.loss_mask_B_T, batch.loss_mask_B_T)
    assert torch.equal(kept.adv_B_T[2:], torch.zeros(2, 4))


def test_compute_advantages_from_turns_writes_per_turn_values_on_their_spans() -> None:
    batch = batch_of([1.0, 0.0], ["a", "b"], ["g", "g"],
                     spans=[[(1, 2), (2, 4)], [(1, 4)]], turn_rewards=[[1.0, 0.5], [0.0]])
    out = compute_advantages(batch, TrainConfig(advantage_source="turn", adv_norm="mean"))
    assert torch.allclose(out.adv_B_T, T([[0, 0.625, 0.125, 0.125], [0, -0.375, -0.375, -0.375]]))


def test_turn_source_without_turn_spans_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="per-turn spans"):
        compute_advantages(batch_of([1.0], ["a"], ["g"]), TrainConfig(advantage_source="turn"))
