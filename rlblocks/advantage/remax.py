"""ReMax: REINFORCE with the greedy response's reward as the baseline."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.advantage.names import ESTIMATORS
from rlblocks.advantage.returns import check_inputs, outcome_advantages, outcome_scores
from rlblocks.interfaces import Advantages


@ESTIMATORS.register("remax")
@torch.no_grad()
def remax(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor | None = None,
    /,
    *,
    baseline_rewards: Tensor,
) -> Advantages:
    """ReMax advantage (Li et al. 2023, arXiv 2310.10505, Algorithm 1).

        Aᵢ = r(x, yᵢ) − r(x, ȳ),   ȳ = greedy decoding of the same prompt x

    broadcast to every valid token of row i. The baseline costs one extra greedy generation per
    prompt and needs no group, so every row gets its own non-zero advantage (there is no "group of
    one" rule here). verl subtracts the baseline from each token's reward-to-go instead; the two
    agree for ``(b)`` rewards, and for ``(b t)`` rewards this follows docs/conventions.md
    (outcome estimators sum over the mask).

    Args:
        rewards: ``(b)`` outcome rewards, or ``(b t)`` per-token rewards summed over ``mask``.
        mask: ``(b t)`` bool, True on the response tokens to train on.
        group_ids: unused; accepted so every estimator shares a signature.
        baseline_rewards: ``(b)`` reward of the greedy response to the prompt of each row.

    Returns:
        ``Advantages``: ``advantages`` (b t) float32 as above; ``returns`` (b t) float32, the
        undiscounted reward-to-go. Both zero where ``mask`` is False, detached (``no_grad``).
    """
    check_inputs(rewards, mask, group_ids)
    if baseline_rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"remax: baseline_rewards must be (b) = {mask.shape[0]}, got "
            f"{tuple(baseline_rewards.shape)}; pass one greedy-baseline reward per row"
        )
    advantage = outcome_scores(rewards, mask) - baseline_rewards.float()
    return outcome_advantages(advantage, rewards, mask)
