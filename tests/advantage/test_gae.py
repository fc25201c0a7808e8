"""Generalized Advantage Estimation: rlblocks/advantage/gae.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlblocks.advantage.gae import gae


def test_hand_worked():
    # one row, three valid tokens, values V = (1, 2, 3), outcome reward 1 on the last token
    # γ = λ = 0.5:
    #   δ2 = 1 + 0.5·0 − 3 = −2        (V after the last token is 0)
    #   δ1 = 0 + 0.5·3 − 2 = −0.5
    #   δ0 = 0 + 0.5·2 − 1 = 0
    #   A2 = −2;  A1 = −0.5 + 0.25·(−2) = −1;  A0 = 0 + 0.25·(−1) = −0.25
    #   returns = A + V = (0.75, 1, 1)
    mask = torch.ones(1, 3, dtype=torch.bool)
    values = torch.tensor([[1.0, 2.0, 3.0]])
    out = gae(torch.tensor([1.0]), mask, values=values, gamma=0.5, lam=0.5)
    assert_close(out.advantages, torch.tensor([[-0.25, -1.0, -2.0]]))
    assert_close(out.returns, torch.tensor([[0.75, 1.0, 1.0]]))


def test_hand_worked_multi_turn():
    # policy tokens 0, 1, 4; tokens 2, 3 are a tool observation (values 50, 60 must not leak);
    # per-token rewards r = (0.5, 0, ·, ·, 1), V = (1, 2, ·, ·, 4), γ = 0.5, λ = 1:
    #   δ4 = 1 − 4 = −3;  δ1 = 0 + 0.5·4 − 2 = 0;  δ0 = 0.5 + 0.5·2 − 1 = 0.5
    #   A4 = −3;  A1 = 0 + 0.5·(−3) = −1.5;  A0 = 0.5 + 0.5·(−1.5) = −0.25
    #   returns = A + V = (0.75, 0.5, 0, 0, 1)
    mask = torch.tensor([[1, 1, 0, 0, 1]], dtype=torch.bool)
    rewards = torch.tensor([[0.5, 0.0, 7.0, 7.0, 1.0]])
    values = torch.tensor([[1.0, 2.0, 50.0, 60.0, 4.0]])
    out = gae(rewards, mask, values=values, gamma=0.5, lam=1.0)
    assert_close(out.advantages, torch.tensor([[-0.25, -1.5, 0.0, 0.0, -3.0]]))
    assert_close(out.returns, torch.tensor([[0.75, 0.5, 0.0, 0.0, 1.0]]))


def gae_loop(rows, values, mask, gamma, lam):
    """Per-row backward loop over the list of valid token indices."""
    advantages, returns = [], []
    for r, v, m in zip(rows, values.tolist(), mask.tolist()):
        valid = [j for j, keep in enumerate(m) if keep]
        adv, ret = [0.0] * len(m), [0.0] * len(m)
        running, next_value = 0.0, 0.0
        for j in reversed(valid):
            delta = r[j] + gamma * next_value - v[j]
            running = delta + gamma * lam * running
            adv[j], ret[j] = running, running + v[j]
            next_value = v[j]
        advantages.append(adv)
        returns.append(ret)
    return torch.tensor(advantages), torch.tensor(returns)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("per_token", [False, True])
def test_matches_loop_reference(batch, ref, gamma, lam, per_token):
    rewards = batch.token_rewards if per_token else batch.rewards
    out = gae(rewards, batch.mask, batch.group_ids, values=batch.values, gamma=gamma, lam=lam)
    rows = ref.row_token_rewards(batch, per_token)
    advantages, returns = gae_loop(rows, batch.values, batch.mask, gamma, lam)
    assert_close(out.advantages, advantages)
    assert_close(out.returns, returns)


@pytest.mark.parametrize("per_token", [False, True])
def test_reward_to_go_when_gamma_lam_one_and_values_zero(batch, ref, per_token):
    rewards = batch.token_rewards if per_token else batch.rewards
    out = gae(rewards, batch.mask, values=torch.zeros(batch.mask.shape))
    expected = ref.returns_reference(batch, per_token, 1.0)
    assert_close(out.advantages, expected)
    assert_close(out.returns, expected)


def test_lambda_zero_is_td_error():
    # λ = 0: Aₜ = δₜ = rₜ + γ V(next valid) − V(t); mask (1, 0, 1), γ = 0.9
    # δ0 = 1 + 0.9·3 − 2 = 1.7;  δ2 = 0.5 + 0 − 3 = −2.5
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    out = gae(
        torch.tensor([[1.0, 9.0, 0.5]]),
        mask,
        values=torch.tensor([[2.0, 8.0, 3.0]]),
        gamma=0.9,
        lam=0.0,
    )
    assert_close(out.advantages, torch.tensor([[1.7, 0.0, -2.5]]))


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.8)])
def test_observation_gap_equals_sequence_without_gap(batch, gamma, lam):
    # move each row's valid tokens to the front (the gap removed), run GAE, and map back
    b, t = batch.mask.shape
    compact_mask = torch.zeros(b, t, dtype=torch.bool)
    compact_rewards = torch.zeros(b, t)
    compact_values = torch.zeros(b, t)
    for i in range(b):
        valid = batch.mask[i].nonzero().flatten()
        compact_mask[i, : len(valid)] = True
        compact_rewards[i, : len(valid)] = batch.token_rewards[i, valid]
        compact_values[i, : len(valid)] = batch.values[i, valid]
    kw = {"gamma": gamma, "lam": lam}
    gapped = gae(batch.token_rewards, batch.mask, values=batch.values, **kw)
    compact = gae(compact_rewards, compact_mask, values=compact_values, **kw)
    assert_close(gapped.advantages[batch.mask], compact.advantages[compact_mask])
    assert_close(gapped.returns[batch.mask], compact.returns[compact_mask])


def test_masked_positions_exactly_zero_and_inputs_untouched(batch):
    values = batch.values.clone().requires_grad_(True)  # NaN where mask is False
    rewards = batch.token_rewards.clone()
    out = gae(rewards, batch.mask, values=values, gamma=0.9, lam=0.9)
    assert (out.advantages[~batch.mask] == 0).all() and (out.returns[~batch.mask] == 0).all()
    assert out.advantages.isfinite().all() and out.returns.isfinite().all()
    assert not out.advantages.requires_grad and not out.returns.requires_grad
    assert out.advantages.dtype == out.returns.dtype == torch.float32
    assert_close(values.detach(), batch.values, equal_nan=True)
    assert_close(rewards, batch.token_rewards, equal_nan=True)


def test_returns_are_advantages_plus_values(batch):
    out = gae(batch.rewards, batch.mask, values=batch.values, gamma=0.95, lam=0.9)
    assert_close(out.returns[batch.mask], (out.advantages + batch.values)[batch.mask])


def test_rejects_bad_values_shape():
    with pytest.raises(ValueError, match="^gae: values must be"):
        gae(torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), values=torch.zeros(2, 4))
