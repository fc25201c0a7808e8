"""CISPO: clip the importance-sampling weight, not the update, so no token loses its gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.base.masked import masked_mean
from rlblocks.losses.names import LOSSES
from rlblocks.losses.ppo import check_loss_inputs, finish_loss, prepare_loss_inputs, ratio_metrics


@LOSSES.register("cispo")
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    /,
    *,
    clip: tuple[float, float] = (1.0, 4.0),
    log_ratio_clamp: float = 20.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token CISPO loss: a REINFORCE term weighted by a clipped, detached IS ratio.

    With r = exp(clamp(logπ_θ − logπ_old, ±log_ratio_clamp))::

        r̂    = clip(r, 1 − ε_low, 1 + ε_high)
        loss = −sg[r̂] · A · logπ_θ · w   where mask, 0 elsewhere

    so ∇loss = −r̂·A·∇logπ_θ: PPO would zero the gradient of a token whose ratio left the
    trust region; CISPO only bounds its weight.

    Reference: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", arXiv 2506.13585, eq. 4-5. The paper imposes no lower bound and tunes only
    ε_high without giving a value. The default (ε_low, ε_high) = (1.0, 4.0), i.e. r̂ ∈ [0, 5],
    follows ScaleRL (Khatri et al. 2025, arXiv 2510.13786), which clips CISPO's weight at 5;
    verl and SkyRL expose the same two knobs.

    Args:
        logprobs: ``(b t)`` log π_θ; the only input with a gradient; computed in float32.
        old_logprobs: ``(b t)`` log π_old; detached.
        advantages: ``(b t)`` float32; detached.
        mask: ``(b t)`` bool, True where the token counts.
        clip: (ε_low, ε_high); the weight is clipped to [1 − ε_low, 1 + ε_high].
        log_ratio_clamp: bound on |logπ_θ − logπ_old| before ``exp``.
        is_weights: optional ``(b t)`` detached per-token weights multiplying the loss (e.g.
            truncated importance sampling for rollout/trainer mismatch); ``None`` means 1.

    Returns:
        ``loss`` ``(b t)`` float32, zero where ``mask`` is False, and detached float32 scalar
        ``metrics`` over valid tokens: ``clip_frac`` (the weight was clipped), split into
        ``clip_frac_low`` and ``clip_frac_high``; ``approx_kl``, ``approx_kl_k3``,
        ``ratio_mean``, ``ratio_max``.
    """
    check_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    eps_low, eps_high = clip
    lp, old, adv, w = prepare_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    log_ratio = (lp.detach() - old).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)  # detached: CISPO's weight carries no gradient
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = finish_loss(-weight * adv * lp, mask, w)

    with torch.no_grad():
        low = ratio < 1.0 - eps_low
        high = ratio > 1.0 + eps_high
        metrics = {
            "clip_frac": masked_mean(low | high, mask),
            "clip_frac_low": masked_mean(low, mask),
            "clip_frac_high": masked_mean(high, mask),
            **ratio_metrics(log_ratio, mask),
        }
    return loss, metrics
