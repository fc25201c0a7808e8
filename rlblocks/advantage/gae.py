"""Generalized Advantage Estimation for PPO with a learned critic."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.advantage.names import ESTIMATORS
from rlblocks.advantage.returns import check_inputs, masked_discounted_cumsum, token_rewards
from rlblocks.interfaces import Advantages


@ESTIMATORS.register("gae")
@torch.no_grad()
def gae(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor | None = None,
    /,
    *,
    values: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> Advantages:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16).

        δₜ = rₜ + γ V(next(t)) − V(t)
        Âₜ = Σ_{l ≥ 0} (γλ)^l δ_{t+l} = δₜ + γλ Â_next(t)
        returns: Rₜ = Âₜ + V(t)            (the λ-return, the critic's regression target)

    Time runs over *valid* tokens only: next(t) is the next token where ``mask`` is True, so in
    a multi-turn rollout the tool-observation tokens (mask False) between two policy turns are
    jumped over: their values and rewards never leak into the advantages, and γ, λ discount per
    policy token. After the last valid token of a row V(next) = 0 (the episode ends). This is
    how verl's ``compute_gae_advantage_return`` treats multi-turn masks. gamma = lam = 1 with
    zero values gives the undiscounted reward-to-go.

    The advantages are *not* whitened here; compose with :func:`rlblocks.advantage.whiten`.

    Args:
        rewards: ``(b)`` outcome rewards, placed on the last valid token of each row, or ``(b t)``
            per-token rewards (e.g. the score on the last token plus a per-token KL penalty);
            entries where ``mask`` is False are ignored.
        mask: ``(b t)`` bool, True on policy-generated tokens.
        group_ids: unused (GAE needs no groups); accepted so every estimator shares a signature.
        values: ``(b t)`` critic values V(t); entries where ``mask`` is False are ignored.
        gamma: discount γ per valid token.
        lam: GAE λ; λ = 1 is the Monte Carlo return minus V, λ = 0 the one-step TD error.

    Returns:
        ``Advantages(advantages, returns)``, both ``(b t)`` float32, zero where ``mask`` is False,
        detached (computed under ``no_grad``; ``values`` may carry a graph, it is not followed).
    """
    check_inputs(rewards, mask, group_ids)
    if values.shape != mask.shape:
        raise ValueError(
            f"gae: values must be (b t) = {tuple(mask.shape)}, got {tuple(values.shape)}; pass "
            "one value per response token, shaped like mask"
        )
    values = torch.where(mask, values.float(), 0.0)  # masked values are never read (may be NaN)
    deltas = token_rewards(rewards, mask) + gamma * _next_valid_values(values, mask) - values
    advantages = masked_discounted_cumsum(deltas, mask, gamma * lam)
    returns = torch.where(mask, advantages + values, 0.0)
    return Advantages(advantages, returns)


def _next_valid_values(values: Tensor, mask: Tensor) -> Tensor:
    """V(next(t)) ``(b t)``: the value at the next valid token after t, 0 if there is none."""
    b, t = mask.shape
    positions = torch.arange(t, device=mask.device).expand(b, t)
    valid_pos = torch.where(mask, positions, t)  # t is a sentinel column holding V = 0
    after = torch.cat([valid_pos[:, 1:], valid_pos.new_full((b, 1), t)], dim=1)
    next_pos = after.flip(1).cummin(1).values.flip(1)  # smallest valid position > t
    padded = torch.cat([values, values.new_zeros(b, 1)], dim=1)
    return padded.gather(1, next_pos)
