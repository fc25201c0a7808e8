"""GSPO: the PPO clip applied to a length-normalised sequence-level importance ratio.

Implemented in the token-level form (GSPO-token): every token of a sequence carries the same
ratio value s_i, but its gradient flows through its own log-prob, so per-token advantages and
per-token masks work unchanged. With one advantage per sequence (the usual case) GSPO-token and
GSPO have the same value and gradient. Aggregate the result with seq-mean-token-mean, as the
paper does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.base.masked import masked_mean, masked_sum
from rlblocks.losses.names import LOSSES
from rlblocks.losses.ppo import (
    check_loss_inputs,
    finish_loss,
    masked_max,
    prepare_loss_inputs,
    ratio_metrics,
)


@LOSSES.register("gspo")
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    /,
    *,
    clip: tuple[float, float] = (3e-4, 4e-4),
    log_ratio_clamp: float = 10.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token GSPO loss (GSPO-token form) with a sequence-level importance ratio.

    For row i with valid tokens T_i (|T_i| = number of True in ``mask[i]``)::

        log s_i   = (1/|T_i|) Σ_{t∈T_i} (logπ_θ(y_t) − logπ_old(y_t))   (length-normalised)
        s_{i,t}   = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)]     (value s_i, gradient s_i·∇logπ_θ(y_t))
        ℓ_{i,t}   = max(−A_{i,t}·s_{i,t}, −A_{i,t}·clip(s_{i,t}, 1 − ε_low, 1 + ε_high))
        loss      = w · ℓ   where mask, 0 elsewhere

    Reference: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071,
    eq. 5-7 (GSPO objective and s_i) and Sec. 4.3 (GSPO-token). Defaults (ε_low, ε_high) =
    (3e-4, 4e-4) are the paper's (Sec. 5.1); the ratio is a geometric mean of token ratios, so
    the clip range is much narrower than PPO's. Cross-checked with verl
    ``compute_policy_loss_gspo``.

    log s_i is clamped to ±``log_ratio_clamp`` before ``exp`` (verl clamps at 10). Because the
    clamp acts on the detached sequence term only, every token keeps its gradient path.
    A row with no valid token gets s_i = 1 and zero loss.

    Args:
        logprobs: ``(b t)`` log π_θ; the only input with a gradient; computed in float32.
        old_logprobs: ``(b t)`` log π_old; detached.
        advantages: ``(b t)`` float32 (usually constant along t); detached.
        mask: ``(b t)`` bool, True where the token counts.
        clip: (ε_low, ε_high) around 1 for the sequence ratio.
        log_ratio_clamp: bound on |log s_i| before ``exp``.
        is_weights: optional ``(b t)`` detached per-token weights multiplying the loss (e.g.
            truncated importance sampling for rollout/trainer mismatch); ``None`` means 1.

    Returns:
        ``loss`` ``(b t)`` float32, zero where ``mask`` is False, and detached float32 scalar
        ``metrics``: ``clip_frac``, ``clip_frac_low``, ``clip_frac_high`` (over valid tokens);
        ``approx_kl``, ``approx_kl_k3``, ``ratio_mean``, ``ratio_max`` of the *token* ratios
        (over valid tokens, for comparison with PPO); ``seq_ratio_mean``, ``seq_ratio_max`` of
        s_i over rows with at least one valid token.
    """
    check_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    eps_low, eps_high = clip
    lp, old, adv, w = prepare_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    token_log_ratio = lp - old  # (b t)
    length = mask.sum(-1).clamp(min=1)  # (b)
    seq_log_ratio = masked_sum(token_log_ratio.detach(), mask, -1) / length  # (b)
    seq_log_ratio = seq_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    # lp − sg[lp] is exactly 0 in value but carries ∇logπ_θ; adding the detached sequence term
    # last keeps full precision in the value (the order verl settled on).
    log_s = (lp - lp.detach()) + seq_log_ratio[:, None]  # (b t)
    s = torch.exp(log_s)
    unclipped = -adv * s
    clipped_loss = -adv * s.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = finish_loss(torch.maximum(unclipped, clipped_loss), mask, w)

    with torch.no_grad():
        clipped = clipped_loss > unclipped
        s_seq = torch.exp(seq_log_ratio)  # (b)
        has_tokens = mask.any(-1)  # (b)
        metrics = {
            "clip_frac": masked_mean(clipped, mask),
            "clip_frac_low": masked_mean(clipped & (s < 1.0), mask),
            "clip_frac_high": masked_mean(clipped & (s > 1.0), mask),
            **ratio_metrics(token_log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp), mask),
            "seq_ratio_mean": masked_mean(s_seq, has_tokens),
            "seq_ratio_max": masked_max(s_seq, has_tokens),
        }
    return loss, metrics
