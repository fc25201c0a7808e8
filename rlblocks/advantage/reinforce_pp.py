"""REINFORCE++: reward-to-go whitened over the whole batch, with or without a group baseline."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.advantage.groups import group_mean, group_size
from rlblocks.advantage.names import ESTIMATORS
from rlblocks.advantage.returns import broadcast, check_inputs, discounted_returns, group_scores
from rlblocks.advantage.whiten import whiten
from rlblocks.interfaces import Advantages


@ESTIMATORS.register("reinforce_pp")
@torch.no_grad()
def reinforce_pp(
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor | None = None,
    /,
    *,
    gamma: float = 1.0,
) -> Advantages:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): no critic, no group; global normalization.

        Gₜ = Σ_{valid s ≥ t} γ^(k(s) − k(t)) rₛ              (reward-to-go over valid tokens)
        Aₜ = (Gₜ − mean_batch G) / √(var_batch G + 1e-8)   (whitened over all valid tokens)

    The paper's token reward is the outcome score on the last token minus a per-token KL
    penalty, rₜ = score·[t = T] − β KLₜ: fold the penalty into a ``(b t)`` ``rewards`` before the
    call. k counts valid tokens, so tool-observation tokens (mask False) are jumped over, as in
    :func:`gae`. (verl instead resets the running return at every mask-False token, which is the
    same for right-padding but cuts multi-turn rollouts at the first observation.) The variance
    is the unbiased one, see :func:`rlblocks.advantage.whiten`.

    Args:
        rewards: ``(b)`` outcome rewards (placed on the last valid token) or ``(b t)`` per-token
            rewards; entries where ``mask`` is False are ignored.
        mask: ``(b t)`` bool, True on policy-generated tokens.
        group_ids: unused; accepted so every estimator shares a signature.
        gamma: discount per valid token.

    Returns:
        ``Advantages(advantages, returns)``: the whitened Aₜ and the raw Gₜ, ``(b t)`` float32,
        zero where ``mask`` is False, detached (``no_grad``).
    """
    check_inputs(rewards, mask, group_ids)
    returns = discounted_returns(rewards, mask, gamma=gamma)
    return Advantages(whiten(returns, mask), returns)


@ESTIMATORS.register("reinforce_pp_baseline")
@torch.no_grad()
def reinforce_pp_baseline(rewards: Tensor, mask: Tensor, group_ids: Tensor, /) -> Advantages:
    """REINFORCE++ with a group-mean baseline (Hu 2025, arXiv 2501.03262, "REINFORCE++-baseline";
    verl ``compute_reinforce_plus_plus_baseline_outcome_advantage``).

        Aᵢ' = rᵢ − mean_{j∈G(i)} rⱼ                 broadcast to the valid tokens of row i
        Aₜ  = (Aₜ' − mean_batch A') / √(var_batch A' + 1e-8)

    The batch statistics run over valid tokens, so a long response weighs more than a short
    one, as in verl. A group of one gets advantage 0 (docs/conventions.md) and is *left out of*
    the batch statistics: its 0 is not an observed centered reward, and whitening it would turn
    it back into a non-zero advantage. (verl uses baseline 0 for such a group, i.e. the raw
    reward, and whitens it with the rest.)

    Arguments and result as for :func:`rlblocks.advantage.rloo` (the outcome estimators'
    signature, docs/conventions.md), with the whitened Aₜ above as ``advantages``.
    """
    scores = group_scores(rewards, mask, group_ids, estimator="rb.advantage.reinforce_pp_baseline")
    centered = scores - group_mean(scores, group_ids)
    in_group = mask & (group_size(group_ids) > 1).unsqueeze(1)
    advantages = whiten(broadcast(centered, in_group), in_group)
    return Advantages(advantages, discounted_returns(rewards, mask))
