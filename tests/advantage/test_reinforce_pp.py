"""REINFORCE++ and REINFORCE++-baseline: rlblocks/advantage/reinforce_pp.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlblocks.advantage.reinforce_pp import reinforce_pp, reinforce_pp_baseline

# row 0: valid tokens 0, 1, 3 (token 2 is an observation); row 1: one valid token
MASK = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.bool)


def test_hand_worked():
    # (b) rewards (1, 3), γ = 0.5, skipping the observation token:
    #   row 0: G3 = 1, G1 = 0.5, G0 = 0.25;  row 1: G0 = 3
    #   valid G: 0.25, 0.5, 1, 3 -> mean 4.75 / 4 = 1.1875
    #   squared deviations 0.87890625 + 0.47265625 + 0.03515625 + 3.28515625 = 4.671875
    #   unbiased var 4.671875 / 3
    out = reinforce_pp(torch.tensor([1.0, 3.0]), MASK, gamma=0.5)
    returns = torch.tensor([[0.25, 0.5, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    scale = 1 / math.sqrt(4.671875 / 3 + 1e-8)
    assert_close(out.returns, returns)
    assert_close(out.advantages, torch.where(MASK, (returns - 1.1875) * scale, 0.0))


def test_baseline_hand_worked():
    # ids (4, 4, 2): rows 0, 1 form a group, row 2 is alone
    # group 4: rewards (1, 2), mean 1.5 -> centered (−0.5, 0.5)
    # tokens: row 0 has 3 valid tokens of −0.5, row 1 one of 0.5; row 2 (alone) is left out
    #   mean (−1.5 + 0.5) / 4 = −0.25; deviations −0.25 (×3), 0.75
    #   squared sum 3·0.0625 + 0.5625 = 0.75, unbiased var 0.75 / 3 = 0.25, std 0.5
    #   A = −0.25 / 0.5 = −0.5 on row 0, 0.75 / 0.5 = 1.5 on row 1, 0 on row 2
    mask = torch.cat([MASK, torch.ones(1, 4, dtype=torch.bool)])
    out = reinforce_pp_baseline(torch.tensor([1.0, 2.0, 9.0]), mask, torch.tensor([4, 4, 2]))
    scale = 0.5 / math.sqrt(0.25 + 1e-8)  # 1 up to the 1e-8 in the square root
    expected = torch.tensor([[-0.5, -0.5, 0, -0.5], [1.5, 0, 0, 0], [0, 0, 0, 0]]) * torch.tensor(
        scale
    )
    assert_close(out.advantages, expected)
    assert_close(out.returns, torch.tensor([[1.0, 1.0, 0, 1.0], [2.0, 0, 0, 0], [9.0] * 4]))


def whiten_lists(rows, mask_rows):
    flat = [v for row, m in zip(rows, mask_rows) for v, keep in zip(row, m) if keep]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / (len(flat) - 1) + 1e-8)
    return [
        [(v - mean) / std if keep else 0.0 for v, keep in zip(row, m)]
        for row, m in zip(rows, mask_rows)
    ]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("per_token", [False, True])
def test_matches_loop_reference(batch, ref, gamma, per_token):
    rewards = batch.token_rewards if per_token else batch.rewards
    out = reinforce_pp(rewards, batch.mask, batch.group_ids, gamma=gamma)
    rows = ref.row_token_rewards(batch, per_token)
    mask_rows = batch.mask.tolist()
    returns = [ref.reward_to_go_list(r, m, gamma) for r, m in zip(rows, mask_rows)]
    assert_close(out.returns, torch.tensor(returns))
    assert_close(out.advantages, torch.tensor(whiten_lists(returns, mask_rows)))


@pytest.mark.parametrize("per_token", [False, True])
def test_baseline_matches_loop_reference(batch, ref, per_token):
    rewards = batch.token_rewards if per_token else batch.rewards
    out = reinforce_pp_baseline(rewards, batch.mask, batch.group_ids)
    scores, ids = ref.outcome_list(batch, per_token), batch.group_ids.tolist()
    rows, kept = [], []
    for i, (gid, mask_row) in enumerate(zip(ids, batch.mask.tolist())):
        group = [scores[j] for j in range(len(ids)) if ids[j] == gid]
        rows.append([scores[i] - sum(group) / len(group)] * len(mask_row))
        kept.append([m and len(group) > 1 for m in mask_row])  # groups of one stay out
    assert_close(out.advantages, torch.tensor(whiten_lists(rows, kept)))
    assert_close(out.returns, ref.returns_reference(batch, per_token))


def test_baseline_permutation_equivariance(batch, check_equivariance):
    check_equivariance(reinforce_pp_baseline, batch)


def test_limits(batch):
    out = reinforce_pp(batch.rewards, batch.mask, gamma=0.9)
    valid = out.advantages[batch.mask]
    assert_close(valid.mean(), torch.tensor(0.0))
    assert_close(valid.var(), torch.tensor(1.0))
    assert (out.advantages[~batch.mask] == 0).all() and (out.returns[~batch.mask] == 0).all()
    # group ids do not matter to plain REINFORCE++
    assert_close(
        reinforce_pp(batch.rewards, batch.mask, batch.group_ids).advantages,
        reinforce_pp(batch.rewards, batch.mask).advantages,
    )
    # the baseline version ignores any per-group shift of the rewards
    shift = (batch.group_ids % 7).float() * 1.5
    base = reinforce_pp_baseline(batch.rewards, batch.mask, batch.group_ids)
    moved = reinforce_pp_baseline(batch.rewards + shift, batch.mask, batch.group_ids)
    assert_close(moved.advantages, base.advantages)
    # equal rewards in every group, or every row alone: all zero
    equal = torch.full_like(batch.rewards, 2.0)
    assert (reinforce_pp_baseline(equal, batch.mask, batch.group_ids).advantages == 0).all()
    alone = torch.arange(batch.rewards.numel())
    assert (reinforce_pp_baseline(batch.rewards, batch.mask, alone).advantages == 0).all()


def test_pure_and_detached(batch):
    rewards = batch.token_rewards.clone().requires_grad_(True)
    out = reinforce_pp(rewards, batch.mask)
    assert not out.advantages.requires_grad and not out.returns.requires_grad
    assert_close(rewards.detach(), batch.token_rewards, equal_nan=True)
