"""ReMax greedy baseline: rlblocks/advantage/remax.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlblocks.advantage.remax import remax

MASK = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)


def test_hand_worked():
    # A = r − r_greedy: (1 − 0.5, 0 − 0.5, 2 − 2) = (0.5, −0.5, 0), on every valid token
    out = remax(torch.tensor([1.0, 0.0, 2.0]), MASK, baseline_rewards=torch.tensor([0.5, 0.5, 2.0]))
    assert_close(out.advantages, torch.tensor([[0.5, 0.5, 0], [0, -0.5, -0.5], [0.0, 0, 0]]))
    assert_close(out.returns, torch.tensor([[1.0, 1.0, 0], [0, 0.0, 0.0], [2.0, 0, 0]]))
    # (b t) rewards are summed over the mask: row 0 gets 0.25 + 0.5 = 0.75 (the 9 is masked)
    per_token = torch.tensor([[0.25, 0.5, 9.0], [9.0, 1.0, 1.0], [3.0, 9.0, 9.0]])
    out = remax(per_token, MASK, baseline_rewards=torch.tensor([0.5, 0.5, 2.0]))
    # A = (0.75 − 0.5, 2 − 0.5, 3 − 2) = (0.25, 1.5, 1); returns are the reward-to-go
    assert_close(out.advantages, torch.tensor([[0.25, 0.25, 0], [0, 1.5, 1.5], [1.0, 0, 0]]))
    assert_close(out.returns, torch.tensor([[0.75, 0.5, 0], [0, 2.0, 1.0], [3.0, 0, 0]]))


@pytest.mark.parametrize("per_token", [False, True])
def test_matches_loop_reference(batch, ref, per_token):
    rewards = batch.token_rewards if per_token else batch.rewards
    greedy = torch.randn(batch.rewards.shape, generator=torch.Generator().manual_seed(1))
    out = remax(rewards, batch.mask, batch.group_ids, baseline_rewards=greedy)
    scores = ref.outcome_list(batch, per_token)
    expected = [s - g for s, g in zip(scores, greedy.tolist())]
    assert_close(out.advantages, ref.broadcast_rows(expected, batch.mask))
    assert_close(out.returns, ref.returns_reference(batch, per_token))


def test_limits(batch):
    # the greedy response as good as the sample: 0
    same = remax(batch.rewards, batch.mask, baseline_rewards=batch.rewards.clone())
    assert (same.advantages == 0).all()
    # a zero baseline is plain REINFORCE: A = r on every valid token, groups of one included
    plain = remax(batch.rewards, batch.mask, baseline_rewards=torch.zeros_like(batch.rewards))
    assert_close(plain.advantages, plain.returns)
    # no groups involved: ids change nothing
    with_ids = remax(
        batch.rewards, batch.mask, batch.group_ids, baseline_rewards=batch.rewards * 0.5
    )
    without = remax(batch.rewards, batch.mask, baseline_rewards=batch.rewards * 0.5)
    assert_close(with_ids.advantages, without.advantages)
    assert (with_ids.advantages[~batch.mask] == 0).all()
    with pytest.raises(ValueError, match="^remax: baseline_rewards must be"):
        remax(batch.rewards, batch.mask, baseline_rewards=torch.zeros(1, 2))
    assert not remax(
        batch.rewards.requires_grad_(), batch.mask, baseline_rewards=batch.rewards
    ).advantages.requires_grad
