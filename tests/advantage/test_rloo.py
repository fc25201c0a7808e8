"""REINFORCE Leave-One-Out: rlblocks/advantage/rloo.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlblocks.advantage.grpo import grpo
from rlblocks.advantage.rloo import rloo

# group 4 = rows 0, 1, 2; group -2 = row 3 alone
IDS = torch.tensor([4, 4, 4, -2])
REWARDS = torch.tensor([1.0, 0.0, 0.5, 3.0])
MASK = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1]], dtype=torch.bool)


def test_hand_worked():
    # row 0: 1 − (0 + 0.5) / 2 = 0.75;  row 1: 0 − (1 + 0.5) / 2 = −0.75
    # row 2: 0.5 − (1 + 0) / 2 = 0;      row 3: a group of one -> 0
    out = rloo(REWARDS, MASK, IDS)
    assert_close(out.advantages, torch.tensor([[0.75, 0.75], [-0.75, 0.0], [0.0, 0.0], [0, 0]]))
    assert_close(out.returns, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.5], [3.0, 3.0]]))


def rloo_loop(scores, ids):
    advantages = []
    for i, gid in enumerate(ids):
        others = [scores[j] for j in range(len(ids)) if ids[j] == gid and j != i]
        advantages.append(scores[i] - sum(others) / len(others) if others else 0.0)
    return advantages


@pytest.mark.parametrize("per_token", [False, True])
def test_matches_loop_reference(batch, ref, per_token):
    rewards = batch.token_rewards if per_token else batch.rewards
    out = rloo(rewards, batch.mask, batch.group_ids)
    expected = rloo_loop(ref.outcome_list(batch, per_token), batch.group_ids.tolist())
    assert_close(out.advantages, ref.broadcast_rows(expected, batch.mask))
    assert_close(out.returns, ref.returns_reference(batch, per_token))


def test_permutation_equivariance(batch, check_equivariance):
    check_equivariance(rloo, batch)


def test_limits(batch):
    # equal rewards -> 0; every row alone -> 0
    assert (
        rloo(torch.full_like(batch.rewards, -2.5), batch.mask, batch.group_ids).advantages == 0
    ).all()
    alone = torch.arange(batch.rewards.numel()) - 100
    assert (rloo(batch.rewards, batch.mask, alone).advantages == 0).all()
    # RLOO = n / (n − 1) · Dr.GRPO for a group of n
    out = rloo(batch.rewards, batch.mask, batch.group_ids)
    n = (batch.group_ids.unsqueeze(0) == batch.group_ids.unsqueeze(1)).sum(-1).float()
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), 0.0).unsqueeze(1)
    dr = grpo(batch.rewards, batch.mask, batch.group_ids, scale_by_std=False)
    assert_close(out.advantages, scale * dr.advantages)
    assert (out.advantages[~batch.mask] == 0).all()
    assert not rloo(REWARDS.clone().requires_grad_(), MASK, IDS).advantages.requires_grad
