"""GPG: group-mean baseline, rescaled for the samples whose group gives no gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.advantage.groups import group_max, group_mean, group_min, group_std
from rlblocks.advantage.names import ESTIMATORS
from rlblocks.advantage.returns import group_scores, outcome_advantages
from rlblocks.interfaces import Advantages


@ESTIMATORS.register("gpg")
@torch.no_grad()
def gpg(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    /,
    *,
    scale_by_std: bool = False,
    eps: float = 1e-6,
) -> Advantages:
    """Group Policy Gradient advantage (Chu et al. 2025, arXiv 2504.02546).

        Aᵢ = α · (rᵢ − mean_{j∈G(i)} rⱼ) / F_norm,   α = B / (B − M),   F_norm ∈ {1, std + eps}

    broadcast to every valid token of row i. B is the number of rows and M the number of rows
    that can give no gradient: those whose group rewards are all equal (every answer right, or
    every answer wrong), groups of one included; they get advantage 0. α rescales the
    remaining rows so that a mean over the batch is not diluted by the rows that carry nothing
    (the paper's "accurate gradient estimation"). ``scale_by_std`` picks F_norm = std + eps
    (unbiased std) over the paper's default F_norm = 1. If no row can give a gradient α = B.

    verl's ``compute_gpg_outcome_advantage`` takes M from the rows with a zero reward instead
    (α = B / #{rᵢ ≠ 0}), which for 0/1 rewards counts correct answers, not mixed groups; we
    follow the paper. The paper's optional threshold β_th is not part of this function.

    Args:
        rewards: ``(b)`` outcome rewards, or ``(b t)`` per-token rewards summed over ``mask``.
        mask: ``(b t)`` bool, True on the response tokens to train on.
        group_ids: ``(b)`` int64, arbitrary ids; equal id = same prompt.
        scale_by_std: divide by the group std (F_norm = std + eps) rather than 1.
        eps: added to the std when ``scale_by_std``.

    Returns:
        ``Advantages``: ``advantages`` (b t) float32 as above; ``returns`` (b t) float32, the
        undiscounted reward-to-go. Both zero where ``mask`` is False, detached (``no_grad``).
    """
    scores = group_scores(rewards, mask, group_ids, estimator=None)
    mixed = group_max(scores, group_ids) > group_min(scores, group_ids)  # (b) rows with a gradient
    alpha = scores.numel() / mixed.sum().clamp(min=1)
    centered = scores - group_mean(scores, group_ids)
    if scale_by_std:
        centered = centered / (group_std(scores, group_ids) + eps)
    advantage = torch.where(mixed, alpha * centered, 0.0)
    return outcome_advantages(advantage, rewards, mask)
