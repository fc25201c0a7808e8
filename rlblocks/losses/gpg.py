"""GPG's loss: the plain policy gradient −A·logπ_θ, no ratio, no clip, no KL."""

from __future__ import annotations

from torch import Tensor

from rlblocks.losses.names import LOSSES
from rlblocks.losses.ppo import check_loss_inputs, finish_loss, prepare_loss_inputs, ratio_metrics

# Only used for the metrics: keeps exp() finite when the policies are far apart.
_METRICS_LOG_RATIO_CLAMP = 20.0


@LOSSES.register("gpg")
def gpg_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    /,
    *,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token plain policy-gradient (REINFORCE) loss, as used by GPG.

    ::

        loss = −A · logπ_θ · w   where mask, 0 elsewhere

    Reference: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
    Model Reasoning", arXiv 2504.02546 (the GPG objective: the policy gradient with group-relative
    advantages and no surrogate, clip or reference KL). Matches verl ``compute_policy_loss_gpg``.
    GPG's advantage correction lives in the ``gpg`` advantage estimator; this is only the loss,
    named ``gpg_loss`` so the two do not clash.

    The gradient is unbiased only on-policy (π_θ = π_old); ``old_logprobs`` is accepted for the
    shared policy-loss signature and used only in the metrics.

    Args:
        logprobs: ``(b t)`` log π_θ; the only input with a gradient; computed in float32.
        old_logprobs: ``(b t)`` log π_old; detached; metrics only.
        advantages: ``(b t)`` float32; detached.
        mask: ``(b t)`` bool, True where the token counts.
        is_weights: optional ``(b t)`` detached per-token weights multiplying the loss (e.g.
            truncated importance sampling for rollout/trainer mismatch); ``None`` means 1.

    Returns:
        ``loss`` ``(b t)`` float32, zero where ``mask`` is False, and detached float32 scalar
        ``metrics`` over valid tokens: ``approx_kl``, ``approx_kl_k3``, ``ratio_mean``,
        ``ratio_max`` (log-ratio clamped to ±20 for these).
    """
    check_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    lp, old, adv, w = prepare_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    loss = finish_loss(-adv * lp, mask, w)
    log_ratio = (lp.detach() - old).clamp(-_METRICS_LOG_RATIO_CLAMP, _METRICS_LOG_RATIO_CLAMP)
    return loss, ratio_metrics(log_ratio, mask)
