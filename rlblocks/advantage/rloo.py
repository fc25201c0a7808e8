"""REINFORCE Leave-One-Out: each sample's baseline is the mean of the others in its group."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.advantage.groups import group_size, group_sum
from rlblocks.advantage.names import ESTIMATORS
from rlblocks.advantage.returns import group_scores, outcome_advantages
from rlblocks.interfaces import Advantages


@ESTIMATORS.register("rloo")
@torch.no_grad()
def rloo(rewards: Tensor, mask: Tensor, group_ids: Tensor, /) -> Advantages:
    """REINFORCE Leave-One-Out advantage (Ahmadian et al. 2024, "Back to Basics", arXiv
    2402.14740; the estimator is Kool et al. 2019's).

        Aᵢ = rᵢ − 1/(n−1) Σ_{j∈G(i), j≠i} rⱼ = n/(n−1) · (rᵢ − mean_{j∈G(i)} rⱼ)

    broadcast to every valid token of row i; n is the size of row i's group. A group of one has
    no other sample to compare with and gets 0 (docs/conventions.md).

    Args:
        rewards: ``(b)`` outcome rewards, or ``(b t)`` per-token rewards summed over ``mask``.
        mask: ``(b t)`` bool, True on the response tokens to train on.
        group_ids: ``(b)`` int64, arbitrary ids; equal id = same prompt.

    Returns:
        ``Advantages``: ``advantages`` (b t) float32 as above; ``returns`` (b t) float32, the
        undiscounted reward-to-go. Both zero where ``mask`` is False, detached (``no_grad``).
    """
    scores = group_scores(rewards, mask, group_ids, estimator="rb.advantage.rloo")
    n = group_size(group_ids)
    others = (group_sum(scores, group_ids) - scores) / (n - 1).clamp(min=1)
    advantage = torch.where(n > 1, scores - others, 0.0)
    return outcome_advantages(advantage, rewards, mask)
