"""Rewards to per-token returns: rlblocks/advantage/returns.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlblocks.advantage.returns import (
    broadcast,
    check_inputs,
    discounted_returns,
    masked_discounted_cumsum,
    outcome_scores,
    token_rewards,
)

NAN = float("nan")
# row 0: valid tokens 0, 1, 3 (token 2 is a tool observation, 4 is padding)
# row 1: one valid token at 0; row 2: no valid token
MASK = torch.tensor(
    [[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]],
    dtype=torch.bool,
)


def test_token_rewards_hand_worked():
    # (b) rewards go on the last valid token: row 0 -> token 3, row 1 -> token 0, row 2 -> dropped
    out = token_rewards(torch.tensor([2.0, -1.0, 5.0]), MASK)
    expected = torch.tensor([[0, 0, 0, 2.0, 0], [-1.0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert_close(out, expected)


def test_outcome_scores_hand_worked():
    per_token = torch.tensor(
        [[1.0, 2.0, NAN, 4.0, 100.0], [3.0, 9.0, 9.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0, 7.0]]
    )
    # row 0: 1 + 2 + 4 = 7 (NaN and 100 are masked); row 1: 3; row 2: nothing -> 0
    assert_close(outcome_scores(per_token, MASK), torch.tensor([7.0, 3.0, 0.0]))
    assert_close(outcome_scores(torch.tensor([1, 2, 3]), MASK), torch.tensor([1.0, 2.0, 3.0]))


def test_discounted_returns_hand_worked():
    per_token = torch.tensor(
        [[1.0, 2.0, NAN, 4.0, 100.0], [3.0, 9.0, 9.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0, 7.0]]
    )
    # γ = 0.5 over valid tokens, the observation token 2 is skipped without discount:
    # row 0: G3 = 4; G1 = 2 + 0.5·4 = 4; G0 = 1 + 0.5·4 = 3.   row 1: G0 = 3.   row 2: all 0
    expected = torch.tensor([[3.0, 4.0, 0, 4.0, 0], [3.0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert_close(discounted_returns(per_token, MASK, gamma=0.5), expected)
    # a (b) reward with γ = 0.5: row 0 gets 8 at token 3, 4 at token 1, 2 at token 0
    expected = torch.tensor([[2.0, 4.0, 0, 8.0, 0], [1.0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert_close(discounted_returns(torch.tensor([8.0, 1.0, 3.0]), MASK, gamma=0.5), expected)


def test_broadcast_hand_worked():
    expected = torch.tensor([[2.0, 2.0, 0, 2.0, 0], [-1.0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert_close(broadcast(torch.tensor([2.0, -1.0, 5.0]), MASK), expected)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.3])
@pytest.mark.parametrize("per_token", [False, True])
def test_matches_loop_reference(batch, ref, gamma, per_token):
    rewards = batch.token_rewards if per_token else batch.rewards
    expected = ref.returns_reference(batch, per_token, gamma)
    assert_close(discounted_returns(rewards, batch.mask, gamma=gamma), expected)
    scores = torch.tensor(ref.outcome_list(batch, per_token))
    assert_close(outcome_scores(rewards, batch.mask), scores)
    assert_close(broadcast(scores, batch.mask), ref.broadcast_rows(scores.tolist(), batch.mask))


def test_limits(batch):
    # γ = 0: each token's return is its own reward
    out = discounted_returns(batch.token_rewards, batch.mask, gamma=0.0)
    assert_close(out, torch.where(batch.mask, batch.token_rewards, 0.0))
    # γ = 1 with a (b) reward: the reward on every valid token
    out = discounted_returns(batch.rewards, batch.mask)
    assert_close(out, broadcast(batch.rewards, batch.mask))
    # the scan with discount 1 of all-ones counts the valid tokens from t to the end
    ones = masked_discounted_cumsum(torch.ones(batch.mask.shape), batch.mask, 1.0)
    remaining = batch.mask.flip(1).cumsum(1).flip(1).float()
    assert_close(ones, torch.where(batch.mask, remaining, 0.0))


def test_check_inputs_rejects_bad_shapes():
    with pytest.raises(ValueError, match="^AdvantageEstimator: mask must be"):
        check_inputs(torch.zeros(3), MASK.float())
    with pytest.raises(ValueError, match="^AdvantageEstimator: rewards must be"):
        check_inputs(torch.zeros(3, 4), MASK)
    with pytest.raises(ValueError, match="^AdvantageEstimator: group_ids must be"):
        check_inputs(torch.zeros(3), MASK, torch.zeros(2, dtype=torch.int64))
