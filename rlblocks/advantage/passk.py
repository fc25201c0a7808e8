"""GRPO pass@k: only the best response of each group is rewarded."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.advantage.groups import group_max, group_size, group_std, group_sum
from rlblocks.advantage.names import ESTIMATORS
from rlblocks.advantage.returns import group_scores, outcome_advantages
from rlblocks.interfaces import Advantages


@ESTIMATORS.register("grpo_passk")
@torch.no_grad()
def grpo_passk(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    /,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> Advantages:
    """GRPO-style pass@k advantage, as verl's ``compute_grpo_passk_outcome_advantage``
    (which cites arXiv 2503.19595); pass@k training is studied by Walder & Karkhanis 2025
    (PKPO, arXiv 2505.15201) and Chen et al. 2025 (arXiv 2508.10751).

        Aᵢ = (r_max − r_second) / (std_{j∈G(i)} rⱼ + eps)   if i is the best row of its group
        Aᵢ = 0                                               otherwise

    broadcast to every valid token of row i. r_max and r_second are the two largest rewards of
    the group, counted with multiplicity, so a tie for the best gives r_max − r_second = 0 and
    the whole group gets 0 whichever tied row is "best" (verl's ``topk`` picks one; the result is
    the same). The pass@k of a group is decided by its best sample, and the margin is how much
    that sample raised it above the rest. std is unbiased (Bessel); ``scale_by_std=False`` drops
    the division. A group of one gets 0 (docs/conventions.md), where verl raises.

    Args:
        rewards: ``(b)`` outcome rewards, or ``(b t)`` per-token rewards summed over ``mask``.
        mask: ``(b t)`` bool, True on the response tokens to train on.
        group_ids: ``(b)`` int64, arbitrary ids; equal id = same prompt.
        scale_by_std: divide the margin by the group std.
        eps: added to the std.

    Returns:
        ``Advantages``: ``advantages`` (b t) float32 as above; ``returns`` (b t) float32, the
        undiscounted reward-to-go. Both zero where ``mask`` is False, detached (``no_grad``).
    """
    scores = group_scores(rewards, mask, group_ids, estimator="rb.advantage.grpo_passk")
    best = group_max(scores, group_ids)
    is_best = scores == best
    n_best = group_sum(is_best.float(), group_ids)
    second = group_max(torch.where(is_best, -torch.inf, scores), group_ids)
    winner = is_best & (n_best == 1) & (group_size(group_ids) > 1)
    margin = best - second
    if scale_by_std:
        margin = margin / (group_std(scores, group_ids) + eps)
    advantage = torch.where(winner, margin, 0.0)
    return outcome_advantages(advantage, rewards, mask)
