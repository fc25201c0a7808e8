"""OPO: the group baseline weighted by response length."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.advantage.groups import group_mean, group_size
from rlblocks.advantage.names import ESTIMATORS
from rlblocks.advantage.returns import group_scores, outcome_advantages
from rlblocks.interfaces import Advantages


@ESTIMATORS.register("opo")
@torch.no_grad()
def opo(rewards: Tensor, mask: Tensor, group_ids: Tensor, /) -> Advantages:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv 2505.23585).

        bᵢ = Σ_{j∈G(i)} Lⱼ rⱼ / Σ_{j∈G(i)} Lⱼ,   Aᵢ = rᵢ − bᵢ

    broadcast to every valid token of row i, with Lⱼ = number of valid tokens of row j. This is
    the variance-minimizing baseline when the squared gradient norm of a response grows with its
    length. A group of one gets 0 (docs/conventions.md; verl would give the raw reward); a group
    whose rows have no valid token at all falls back to the plain mean (its advantages are
    masked out anyway).

    Args:
        rewards: ``(b)`` outcome rewards, or ``(b t)`` per-token rewards summed over ``mask``.
        mask: ``(b t)`` bool, True on the response tokens to train on; its row sums are L.
        group_ids: ``(b)`` int64, arbitrary ids; equal id = same prompt.

    Returns:
        ``Advantages``: ``advantages`` (b t) float32 as above; ``returns`` (b t) float32, the
        undiscounted reward-to-go. Both zero where ``mask`` is False, detached (``no_grad``).
    """
    scores = group_scores(rewards, mask, group_ids, estimator="rb.advantage.opo")
    baseline = group_mean(scores, group_ids, weights=mask.sum(-1))
    advantage = torch.where(group_size(group_ids) > 1, scores - baseline, 0.0)
    return outcome_advantages(advantage, rewards, mask)
