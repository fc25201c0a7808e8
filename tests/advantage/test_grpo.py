"""GRPO and Dr.GRPO outcome advantages: rlblocks/advantage/grpo.py."""

from __future__ import annotations

import math
import statistics
from functools import partial

import pytest
import torch
from torch.testing import assert_close

from rlblocks.advantage.grpo import grpo
from rlblocks.advantage.returns import discounted_returns

EPS = 1e-6
# ids [7, 3, 7, 3, 9]: group 7 = rows 0, 2; group 3 = rows 1, 3; group 9 = row 4 alone
IDS = torch.tensor([7, 3, 7, 3, 9])
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)


def test_hand_worked():
    # group 7: r = (1, 0), mean 0.5, unbiased std √((0.25 + 0.25) / 1) = √0.5
    #   A = ±0.5 / (√0.5 + eps)
    # group 3: r = (0, 0): std 0 -> A = 0 / eps = 0
    # group 9: a group of one -> 0
    a = 0.5 / (math.sqrt(0.5) + EPS)
    out = grpo(REWARDS, MASK, IDS)
    expected = torch.tensor([[a, a, 0], [0, 0, 0], [-a, -a, -a], [0, 0, 0], [0, 0, 0]])
    assert_close(out.advantages, expected)
    # returns: the outcome reward on every valid token
    expected_returns = torch.where(MASK, REWARDS.unsqueeze(1), 0.0)
    assert_close(out.returns, expected_returns)


def test_dr_grpo_hand_worked():
    # no std: group 7 -> 1 − 0.5 = 0.5 and 0 − 0.5 = −0.5; others 0
    out = grpo(REWARDS, MASK, IDS, scale_by_std=False)
    expected = torch.tensor([[0.5, 0.5, 0], [0, 0, 0], [-0.5, -0.5, -0.5], [0, 0, 0], [0, 0, 0]])
    assert_close(out.advantages, expected)


def grpo_loop(scores, ids, scale_by_std):
    advantages = []
    for i, gid in enumerate(ids):
        group = [scores[j] for j in range(len(ids)) if ids[j] == gid]
        if len(group) == 1:
            advantages.append(0.0)
            continue
        a = scores[i] - sum(group) / len(group)
        if scale_by_std:
            a /= statistics.stdev(group) + EPS
        advantages.append(a)
    return advantages


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("per_token", [False, True])
def test_matches_loop_reference(batch, ref, scale_by_std, per_token):
    rewards = batch.token_rewards if per_token else batch.rewards
    out = grpo(rewards, batch.mask, batch.group_ids, scale_by_std=scale_by_std)
    scores = ref.outcome_list(batch, per_token)
    expected = grpo_loop(scores, batch.group_ids.tolist(), scale_by_std)
    assert_close(out.advantages, ref.broadcast_rows(expected, batch.mask))
    assert_close(out.returns, ref.returns_reference(batch, per_token))


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_permutation_equivariance(batch, check_equivariance, scale_by_std):
    check_equivariance(partial(grpo, scale_by_std=scale_by_std), batch)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_equal_rewards_and_singletons_give_zero(batch, scale_by_std):
    equal = torch.full_like(batch.rewards, 0.7)
    out = grpo(equal, batch.mask, batch.group_ids, scale_by_std=scale_by_std)
    assert (out.advantages == 0).all()
    alone = torch.arange(batch.rewards.numel()) * 11  # every row its own group
    assert (grpo(batch.rewards, batch.mask, alone).advantages == 0).all()


def test_limits(batch, ref):
    out = grpo(batch.rewards, batch.mask, batch.group_ids)
    assert (out.advantages[~batch.mask] == 0).all() and (out.returns[~batch.mask] == 0).all()
    # shifting every reward by a constant changes nothing
    shifted = grpo(batch.rewards + 3.0, batch.mask, batch.group_ids)
    assert_close(shifted.advantages, out.advantages)
    # Dr.GRPO: within each group the per-row advantages sum to 0
    dr = grpo(batch.rewards, batch.mask, batch.group_ids, scale_by_std=False)
    per_row = dr.advantages.sum(-1) / batch.mask.sum(-1)  # every row has a valid token
    for rows in ref.groups_of(batch.group_ids.tolist()).values():
        assert_close(per_row[rows].sum(), torch.tensor(0.0))
    assert_close(out.returns, discounted_returns(batch.rewards, batch.mask))


def test_pure_and_detached():
    rewards = REWARDS.clone().requires_grad_(True)
    out = grpo(rewards, MASK, IDS)
    assert not out.advantages.requires_grad
    assert_close(rewards.detach(), REWARDS)
    assert out.advantages.dtype == torch.float32


def test_rewards_at_the_float32_limits_give_the_float64_advantage():
    # Rewards near float32's largest value (3.4e38): the group's squared deviations overflow a
    # float32 sum, so a float32 std is inf (or the centred reward itself is). Hand-worked for
    # the pair (r, -r): mean 0, unbiased std = r·√2, A = ±r / (r·√2) = ±1/√2, whatever r is.
    r = 1.13e38
    rewards = torch.tensor([r, -r, 3e38, 3e38, -3e38, 0.5])
    ids = torch.tensor([0, 0, 1, 1, 1, 1])
    advantages = grpo(rewards, torch.ones(6, 1, dtype=torch.bool), ids).advantages[:, 0]
    assert torch.isfinite(advantages).all(), advantages
    assert_close(advantages[:2], torch.tensor([1, -1]) / math.sqrt(2))
    group = [3e38, 3e38, -3e38, 0.5]  # the slow reference, in Python's float64
    mean, std = statistics.fmean(group), statistics.stdev(group)
    expected = torch.tensor([(x - mean) / (std + EPS) for x in group], dtype=torch.float32)
    assert_close(advantages[2:], expected)
