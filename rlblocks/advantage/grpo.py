"""GRPO's group-normalized outcome advantage, and Dr.GRPO without the std."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from rlblocks.advantage.groups import group_mean, group_size, group_std
from rlblocks.advantage.names import ESTIMATORS
from rlblocks.advantage.returns import group_scores, outcome_advantages
from rlblocks.interfaces import Advantages


@ESTIMATORS.register("grpo")
@torch.no_grad()
def grpo(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    /,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> Advantages:
    """Group Relative Policy Optimization outcome advantage (Shao et al. 2024, DeepSeekMath,
    arXiv 2402.03300, sec. 4.1.2 "outcome supervision").

        Aᵢ = (rᵢ − mean_{j∈G(i)} rⱼ) / (std_{j∈G(i)} rⱼ + eps)     on every valid token of row i

    std is the unbiased (Bessel, n − 1) standard deviation, as in verl and TRL (``torch.std``).
    ``scale_by_std=False`` drops the division, Aᵢ = rᵢ − mean: Dr.GRPO (Liu et al. 2025,
    "Understanding R1-Zero-Like Training", arXiv 2503.20783), which removes the
    question-difficulty bias of the std. A group whose rewards are all equal gets 0; a group of
    one gets 0 (docs/conventions.md), where verl would hand the raw reward through.

    Args:
        rewards: ``(b)`` outcome rewards, or ``(b t)`` per-token rewards summed over ``mask``.
        mask: ``(b t)`` bool, True on the response tokens to train on.
        group_ids: ``(b)`` int64, arbitrary ids; equal id = same prompt.
        scale_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: added to the std, so equal rewards give 0 rather than 0/0.

    Returns:
        ``Advantages``: ``advantages`` (b t) float32 as above; ``returns`` (b t) float32, the
        undiscounted reward-to-go (the outcome reward on every valid token for ``(b)`` rewards).
        Both zero where ``mask`` is False, detached (computed under ``no_grad``).
    """
    # float64: a float32 reward near 3.4e38 overflows the centring and the squares of the std
    scores = group_scores(rewards, mask, group_ids, estimator="rb.advantage.grpo").double()
    centered = scores - group_mean(scores, group_ids)
    if scale_by_std:
        centered = centered / (group_std(scores, group_ids) + eps)
    centered = torch.where(group_size(group_ids) > 1, centered, 0.0)
    return outcome_advantages(centered.float(), rewards, mask)


# Dr.GRPO (Liu et al. 2025): the group mean subtracted, no division by the group's std.
ESTIMATORS.register("dr_grpo", partial(grpo, scale_by_std=False))
