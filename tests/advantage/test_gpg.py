"""Group Policy Gradient advantage: rlblocks/advantage/gpg.py.

Not test_gpg.py: tests/ has no __init__.py files, and tests/losses/test_gpg.py owns that name.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch.testing import assert_close

from rlblocks.advantage.gpg import gpg
from rlblocks.advantage.grpo import grpo

EPS = 1e-6
# group 1 = rows 0, 1 (mixed); group 2 = rows 2, 3 (all right); group 3 = row 4 alone
IDS = torch.tensor([1, 1, 2, 2, 3])
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
MASK = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 1], [1, 1]], dtype=torch.bool)


def test_hand_worked():
    # B = 5 rows; M = 3 give no gradient (group 2 all equal, group 3 alone): α = 5 / 2 = 2.5
    # group 1: mean 0.5 -> A = 2.5·(±0.5) = ±1.25; everything else 0
    out = gpg(REWARDS, MASK, IDS)
    expected = torch.tensor([[1.25, 1.25], [-1.25, 0.0], [0, 0], [0, 0], [0, 0]])
    assert_close(out.advantages, expected)
    # F_norm = std + eps, the group-1 std is √0.5: A = ±1.25 / (√0.5 + eps)
    a = 1.25 / (math.sqrt(0.5) + EPS)
    out = gpg(REWARDS, MASK, IDS, scale_by_std=True)
    assert_close(out.advantages, torch.tensor([[a, a], [-a, 0.0], [0, 0], [0, 0], [0, 0]]))
    assert_close(out.returns, torch.where(MASK, REWARDS.unsqueeze(1), 0.0))


def gpg_loop(scores, ids, scale_by_std):
    groups = {gid: [scores[j] for j in range(len(ids)) if ids[j] == gid] for gid in ids}
    mixed = [max(groups[gid]) > min(groups[gid]) for gid in ids]
    alpha = len(ids) / max(sum(mixed), 1)
    advantages = []
    for i, gid in enumerate(ids):
        if not mixed[i]:
            advantages.append(0.0)
            continue
        group = groups[gid]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        norm = std + EPS if scale_by_std else 1.0
        advantages.append(alpha * (scores[i] - mean) / norm)
    return advantages


@pytest.mark.parametrize("scale_by_std", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_matches_loop_reference(batch, ref, per_token, scale_by_std):
    rewards = batch.token_rewards if per_token else batch.rewards
    out = gpg(rewards, batch.mask, batch.group_ids, scale_by_std=scale_by_std)
    scores = ref.outcome_list(batch, per_token)
    expected = gpg_loop(scores, batch.group_ids.tolist(), scale_by_std)
    assert_close(out.advantages, ref.broadcast_rows(expected, batch.mask))
    assert_close(out.returns, ref.returns_reference(batch, per_token))


@pytest.mark.parametrize("scale_by_std", [False, True])
def test_permutation_equivariance(batch, check_equivariance, scale_by_std):
    check_equivariance(partial(gpg, scale_by_std=scale_by_std), batch)


def test_limits(batch_factory):
    # every group mixed: α = 1, GPG is Dr.GRPO (F_norm = 1) or GRPO (F_norm = std + eps)
    ids = torch.tensor([10, 10, 10, 20, 20])
    rewards = torch.tensor([0.0, 1.0, 1.0, 2.0, -1.0])
    mask = torch.ones(5, 3, dtype=torch.bool)
    for scale in (False, True):
        expected = grpo(rewards, mask, ids, scale_by_std=scale).advantages
        assert_close(gpg(rewards, mask, ids, scale_by_std=scale).advantages, expected)
    # no group with a gradient: all 0 (and no division by zero)
    batch = batch_factory(0)
    equal = torch.full_like(batch.rewards, 1.0)
    assert (gpg(equal, batch.mask, batch.group_ids).advantages == 0).all()
    out = gpg(batch.rewards, batch.mask, batch.group_ids)
    assert out.advantages.isfinite().all() and (out.advantages[~batch.mask] == 0).all()
    assert not gpg(REWARDS.clone().requires_grad_(), MASK, IDS).advantages.requires_grad
