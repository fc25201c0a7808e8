"""Rewards in, per-token returns out: the plumbing every estimator shares.

An estimator accepts ``rewards`` either as ``(b)`` outcome rewards, one per sequence, or as
``(b t)`` per-token rewards. Two views are derived from either:

- the outcome *score* ``(b)``: the reward itself, or the ``(b t)`` rewards summed over the mask;
- per-token rewards ``(b t)``: the ``(b t)`` input, or the outcome reward placed on the last
  valid token of its row.

Tokens where ``mask`` is False (padding, or tool-observation tokens in a multi-turn rollout)
never contribute: their rewards are ignored and the time recursions jump over them, so the
"next" token of a valid token is the next *valid* one and discounting counts valid tokens only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.advantage.groups import warn_if_no_group
from rlblocks.interfaces import Advantages


def check_inputs(rewards: Tensor, mask: Tensor, group_ids: Tensor | None = None) -> None:
    """Raise ``ValueError`` unless the shapes and dtypes follow docs/conventions.md."""
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(
            f"AdvantageEstimator: mask must be (b t) bool, got {mask.dtype} "
            f"{tuple(mask.shape)}; pass rollouts.response_mask"
        )
    if rewards.shape not in (mask.shape, mask.shape[:1]):
        raise ValueError(
            f"AdvantageEstimator: rewards must be (b) or (b t) = {tuple(mask.shape)}, got "
            f"{tuple(rewards.shape)}; pass one reward per row, or one per response token"
        )
    if group_ids is not None and group_ids.shape != mask.shape[:1]:
        raise ValueError(
            f"AdvantageEstimator: group_ids must be (b) = {mask.shape[0]}, got "
            f"{tuple(group_ids.shape)}; pass one group id per row (rollouts.group_ids)"
        )


def outcome_scores(rewards: Tensor, mask: Tensor) -> Tensor:
    """One score per sequence, (b) float32: a (b) input as is, a (b t) one summed over ``mask``."""
    if rewards.dim() == 1:
        return rewards.float()
    return torch.where(mask, rewards.float(), 0.0).sum(-1)


def group_scores(
    rewards: Tensor, mask: Tensor, group_ids: Tensor, *, estimator: str | None
) -> Tensor:
    """The opening of every outcome estimator: check the inputs, warn (through
    :func:`warn_if_no_group`, naming ``estimator``; ``None`` for no warning) when no group has
    two rows, and return the outcome scores ``(b)`` float32."""
    check_inputs(rewards, mask, group_ids)
    if estimator is not None:
        warn_if_no_group(group_ids, estimator=estimator)
    return outcome_scores(rewards, mask)


def outcome_advantages(advantage: Tensor, rewards: Tensor, mask: Tensor) -> Advantages:
    """The closing of every outcome estimator: one ``advantage`` ``(b)`` per row spread over its
    valid tokens, with the undiscounted reward-to-go of ``rewards`` as the returns."""
    return Advantages(broadcast(advantage, mask), discounted_returns(rewards, mask))


def token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards ``(b t)`` float32, zero where ``mask`` is False.

    A ``(b)`` reward goes on the last valid token of its row (dropped if the row has none).
    """
    if rewards.dim() == 2:
        return torch.where(mask, rewards.float(), 0.0)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(-1)  # (b) index of the last valid token
    placed = torch.where(last >= 0, rewards.float(), 0.0)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return out.scatter(1, last.clamp(min=0).unsqueeze(1), placed.unsqueeze(1))


def broadcast(scores: Tensor, mask: Tensor) -> Tensor:
    """Spread one value per sequence ``(b)`` over its valid tokens: ``(b t)`` float32."""
    return torch.where(mask, scores.float().unsqueeze(1), 0.0)


def masked_discounted_cumsum(values: Tensor, mask: Tensor, discount: float) -> Tensor:
    """yₜ = xₜ + discount · y_next(t), with next(t) the next *valid* token after t.

    ``values`` and ``mask`` are ``(b t)``; the result is ``(b t)`` float32, zero where ``mask``
    is False. Masked-out values are never read, even if NaN. One pass over t (the recursion is
    sequential in time), vectorized over rows.
    """
    values = values.float()
    out = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=torch.float32, device=values.device)
    for t in reversed(range(values.shape[1])):
        valid = mask[:, t]
        running = torch.where(valid, values[:, t] + discount * running, running)
        out[:, t] = running
    return torch.where(mask, out, 0.0)


def discounted_returns(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Reward-to-go Gₜ = Σ_{valid s ≥ t} γ^(k(s) − k(t)) rₛ, k counting valid tokens: ``(b t)``.

    ``rewards`` is ``(b)`` (placed on the last valid token) or ``(b t)``. With a ``(b)`` reward and
    γ = 1 this is the outcome reward on every valid token. Zero where ``mask`` is False.
    """
    return masked_discounted_cumsum(token_rewards(rewards, mask), mask, gamma)
