"""Supervised fine-tuning as a policy loss: the negative log-likelihood of the target tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.base.masked import masked_mean


def nll(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, /
) -> tuple[Tensor, dict[str, Tensor]]:
    """ℓ_t = −log π_θ(y_t | x, y_<t) on every target token: SFT's cross-entropy, per token.

    A `PolicyLoss` like the others, so that one `PolicyTrainer` and its update loop serve SFT
    and RL: ``policy.step(batch, torch.zeros(len(batch)), loss_fn=nll)`` is one SFT step,
    reduced by the trainer's aggregation (``token_mean``: the mean over every target token of
    the mini-batch, the usual SFT loss; TRL's and verl's SFT trainers take the same token mean).
    ``old_logprobs`` and ``advantages`` are ignored: maximum likelihood is the policy gradient
    with advantage 1 and no importance ratio. Shapes ``(b t)``, ``mask`` bool (False on prompt,
    padding and tokens not to learn). Metric: ``nll``, the mean over valid tokens.
    """
    logprobs = logprobs.to(torch.promote_types(logprobs.dtype, torch.float32))
    loss = torch.where(
        mask, -logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    )
    return loss, {"nll": masked_mean(loss.detach(), mask)}


__all__ = ["nll"]
