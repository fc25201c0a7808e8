"""GRPO pass@k: rlblocks/advantage/passk.py."""

from __future__ import annotations

import math
import statistics
from functools import partial

import pytest
import torch
from torch.testing import assert_close

from rlblocks.advantage.passk import grpo_passk

EPS = 1e-6
# group 0 = rows 0, 1, 2 (distinct); group 6 = rows 3, 4, 5 (tie for best); group 9 = row 6 alone
IDS = torch.tensor([0, 0, 0, 6, 6, 6, 9])
REWARDS = torch.tensor([0.2, 0.9, 0.5, 1.0, 1.0, 0.0, 3.0])
MASK = torch.ones(7, 2, dtype=torch.bool)


def test_hand_worked():
    # group 0: best 0.9 (row 1), second 0.5 -> margin 0.4
    #   mean 1.6 / 3; squared deviations sum 0.74 / 3, unbiased var (0.74 / 3) / 2 = 0.74 / 6
    #   A_1 = 0.4 / (√(0.74 / 6) + eps), rows 0 and 2 get 0
    # group 6: two rows tie at 1.0 -> margin 0 for everyone; group 9 alone -> 0
    a = 0.4 / (math.sqrt(0.74 / 6) + EPS)
    expected = torch.zeros(7, 2)
    expected[1] = a
    assert_close(grpo_passk(REWARDS, MASK, IDS).advantages, expected)
    expected[1] = 0.4  # without the std
    assert_close(grpo_passk(REWARDS, MASK, IDS, scale_by_std=False).advantages, expected)


def passk_loop(scores, ids, scale_by_std):
    advantages = [0.0] * len(ids)
    for gid in set(ids):
        rows = [j for j in range(len(ids)) if ids[j] == gid]
        if len(rows) < 2:
            continue
        ranked = sorted(rows, key=lambda j: scores[j], reverse=True)
        margin = scores[ranked[0]] - scores[ranked[1]]
        if scale_by_std:
            margin /= statistics.stdev([scores[j] for j in rows]) + EPS
        advantages[ranked[0]] = margin
    return advantages


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("per_token", [False, True])
def test_matches_loop_reference(batch, ref, scale_by_std, per_token):
    rewards = batch.token_rewards if per_token else batch.rewards
    out = grpo_passk(rewards, batch.mask, batch.group_ids, scale_by_std=scale_by_std)
    expected = passk_loop(
        ref.outcome_list(batch, per_token), batch.group_ids.tolist(), scale_by_std
    )
    assert_close(out.advantages, ref.broadcast_rows(expected, batch.mask))
    assert_close(out.returns, ref.returns_reference(batch, per_token))


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_permutation_equivariance(batch, check_equivariance, scale_by_std):
    check_equivariance(partial(grpo_passk, scale_by_std=scale_by_std), batch)


def test_limits(batch, ref):
    # equal rewards and groups of one -> 0
    equal = torch.full_like(batch.rewards, 0.3)
    assert (grpo_passk(equal, batch.mask, batch.group_ids).advantages == 0).all()
    alone = torch.arange(batch.rewards.numel())
    assert (grpo_passk(batch.rewards, batch.mask, alone).advantages == 0).all()
    # at most one row per group is non-zero, it is a best row, and its advantage is ≥ 0
    out = grpo_passk(batch.rewards, batch.mask, batch.group_ids)
    per_row = out.advantages.sum(-1)
    for rows in ref.groups_of(batch.group_ids.tolist()).values():
        nonzero = [r for r in rows if per_row[r] != 0]
        assert len(nonzero) <= 1
        for r in nonzero:
            assert per_row[r] > 0 and batch.rewards[r] == batch.rewards[rows].max()
    assert (out.advantages[~batch.mask] == 0).all()
    assert not grpo_passk(REWARDS.clone().requires_grad_(), MASK, IDS).advantages.requires_grad
