"""OPO length-weighted baseline: rlblocks/advantage/opo.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlblocks.advantage.grpo import grpo
from rlblocks.advantage.opo import opo

# group 5 = rows 0, 1 (lengths 1 and 3); group 8 = row 2 alone
IDS = torch.tensor([5, 5, 8])
REWARDS = torch.tensor([1.0, 0.0, 4.0])
MASK = torch.tensor([[0, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def test_hand_worked():
    # group 5: b = (1·1 + 3·0) / (1 + 3) = 0.25 -> A = (0.75, −0.25); row 2 alone -> 0
    out = opo(REWARDS, MASK, IDS)
    expected = torch.tensor([[0, 0.75, 0], [-0.25, -0.25, -0.25], [0.0, 0.0, 0]])
    assert_close(out.advantages, expected)
    assert_close(out.returns, torch.tensor([[0, 1.0, 0], [0.0, 0.0, 0.0], [4.0, 4.0, 0]]))


def opo_loop(scores, lengths, ids):
    advantages = []
    for i, gid in enumerate(ids):
        rows = [j for j in range(len(ids)) if ids[j] == gid]
        if len(rows) == 1:
            advantages.append(0.0)
            continue
        baseline = sum(lengths[j] * scores[j] for j in rows) / sum(lengths[j] for j in rows)
        advantages.append(scores[i] - baseline)
    return advantages


@pytest.mark.parametrize("per_token", [False, True])
def test_matches_loop_reference(batch, ref, per_token):
    rewards = batch.token_rewards if per_token else batch.rewards
    out = opo(rewards, batch.mask, batch.group_ids)
    lengths = [sum(row) for row in batch.mask.tolist()]
    expected = opo_loop(ref.outcome_list(batch, per_token), lengths, batch.group_ids.tolist())
    assert_close(out.advantages, ref.broadcast_rows(expected, batch.mask))
    assert_close(out.returns, ref.returns_reference(batch, per_token))


def test_permutation_equivariance(batch, check_equivariance):
    check_equivariance(opo, batch)


def test_limits(batch):
    # equal rewards -> 0 whatever the lengths; every row alone -> 0
    equal = torch.full_like(batch.rewards, 0.1)
    assert (opo(equal, batch.mask, batch.group_ids).advantages == 0).all()
    alone = torch.arange(batch.rewards.numel()) * 3
    assert (opo(batch.rewards, batch.mask, alone).advantages == 0).all()
    # equal lengths: the plain group mean, i.e. Dr.GRPO
    full = torch.ones_like(batch.mask)
    dr = grpo(batch.rewards, full, batch.group_ids, scale_by_std=False)
    assert_close(opo(batch.rewards, full, batch.group_ids).advantages, dr.advantages)
    out = opo(batch.rewards, batch.mask, batch.group_ids)
    assert (out.advantages[~batch.mask] == 0).all() and (out.returns[~batch.mask] == 0).all()
    assert not opo(REWARDS.clone().requires_grad_(), MASK, IDS).advantages.requires_grad
