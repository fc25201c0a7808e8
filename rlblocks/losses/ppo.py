"""PPO's clipped surrogate, with DAPO's clip-higher and dual clip for negative advantages.

The loss kit at the bottom (input checks, NaN-safe masking, the surrogate terms, clip and ratio
metrics) is shared by the other policy losses of this package (GSPO, CISPO, GPG, Clip-Cov,
KL-Cov), and is public for a loss of one's own, so that every loss masks, casts and reports in
exactly the same way. A loss built from it reads::

    check_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    lp, old, adv, w = prepare_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    loss = finish_loss(<per-token loss of lp, old, adv>, mask, w)
    return loss, ratio_metrics(lp - old, mask)

Masking is done with ``torch.where`` *before* any arithmetic: masked-out tokens may hold
``-inf``/NaN log-probs (padding, tool observations), and multiplying by a 0/1 mask would turn
them into NaN values and NaN gradients (``0 * inf``). Replacing them by finite constants first
keeps both the value and the gradient of every masked token exactly zero.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlblocks.base.masked import masked_mean
from rlblocks.losses.names import LOSSES


@LOSSES.register("clipped_surrogate")
def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    /,
    *,
    clip: tuple[float, float] = (0.2, 0.2),
    dual_clip: float | None = 3.0,
    log_ratio_clamp: float = 20.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO clipped surrogate loss with clip-higher and dual clip.

    With r = exp(clamp(logπ_θ − logπ_old, −log_ratio_clamp, +log_ratio_clamp)) and
    clip = (ε_low, ε_high)::

        ℓ = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))          (PPO, clip-higher)
        ℓ = min(ℓ, −A·c)                       where A < 0          (dual clip, c = dual_clip)
        loss = w · ℓ   where mask, 0 elsewhere                       (w = is_weights, or 1)

    References: Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
    arXiv 1707.06347, eq. 7 (with ε_low = ε_high); Yu et al. 2025, "DAPO", arXiv 2503.14476,
    Sec. 3.1 "Clip-Higher" (separate ε_low, ε_high; DAPO uses (0.2, 0.28)); Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep RL", arXiv 1912.09729 (dual clip: for
    A < 0 a huge ratio would give an unbounded loss, so it is capped at −A·c, c > 1).

    The log-ratio is clamped before ``exp`` for numerical stability (as verl does); beyond the
    clamp the token has no gradient.

    Args:
        logprobs: ``(b t)`` log π_θ of the sampled tokens; the only input with a gradient.
            Any float dtype; computed in float32.
        old_logprobs: ``(b t)`` log π_old (the policy that sampled); detached.
        advantages: ``(b t)`` float32; detached.
        mask: ``(b t)`` bool, True where the token counts.
        clip: (ε_low, ε_high); the ratio is clipped to [1 − ε_low, 1 + ε_high].
        dual_clip: c > 1, the cap on the loss of negative-advantage tokens in units of −A;
            ``None`` disables dual clip.
        log_ratio_clamp: |logπ_θ − logπ_old| is clamped to this before ``exp``.
        is_weights: optional ``(b t)`` per-token importance weights, detached, that multiply
            the per-token loss, e.g. truncated importance sampling
            ``min(π_old / π_rollout, C)`` to correct the mismatch between the rollout engine and
            the trainer. ``None`` means weight 1.

    Returns:
        ``loss`` ``(b t)`` float32, zero where ``mask`` is False (aggregate it with
        ``aggregate``), and ``metrics``: detached float32 scalars, means over valid tokens:
        ``clip_frac`` (the clipped branch is active, i.e. the token has no gradient through
        the clip), split into ``clip_frac_low`` (r < 1 − ε_low) and ``clip_frac_high``
        (r > 1 + ε_high); ``dual_clip_frac``; ``approx_kl`` (k1 = mean of logπ_old − logπ_θ)
        and ``approx_kl_k3`` (mean of r − 1 − log r), both estimates of KL(π_old ‖ π_θ);
        ``ratio_mean`` and ``ratio_max``.
    """
    check_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    lp, old, adv, w = prepare_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    terms = surrogate_terms(
        lp, old, adv, clip=clip, dual_clip=dual_clip, log_ratio_clamp=log_ratio_clamp
    )
    loss = finish_loss(terms.loss, mask, w)
    metrics = {**clip_metrics(terms, mask), **ratio_metrics(terms.log_ratio, mask)}
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# The loss kit: shared by the policy losses of rlblocks.losses, and by a loss of one's own.
# ---------------------------------------------------------------------------------------------


class SurrogateTerms(NamedTuple):
    """Per-token pieces of the clipped surrogate (`surrogate_terms`), all ``(b t)``."""

    loss: Tensor  # float32, with gradient
    log_ratio: Tensor  # float32, clamped, with gradient
    ratio: Tensor  # float32, detached
    clipped: Tensor  # bool: the clip branch is active (no gradient through the ratio)
    dual_clipped: Tensor  # bool: the dual-clip cap −A·c is active


def check_loss_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    is_weights: Tensor | None = None,
) -> None:
    """Raise early, with a readable message, on a wrong mask dtype or mismatched shapes.

    ``mask`` must be bool; ``old_logprobs``, ``advantages``, ``mask`` and ``is_weights`` (when
    given) must all have the ``(b t)`` shape of ``logprobs``. ``TypeError`` for the dtype,
    ``ValueError`` naming the first misshapen input. Reads no values (no host sync).
    """
    if mask.dtype != torch.bool:
        raise TypeError(
            f"PolicyLoss: mask must be bool (True = token counts), got {mask.dtype}; pass "
            "rollouts.response_mask, or convert with .bool()"
        )
    named = {"old_logprobs": old_logprobs, "advantages": advantages, "mask": mask}
    if is_weights is not None:
        named["is_weights"] = is_weights
    for name, tensor in named.items():
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"PolicyLoss: {name} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(logprobs.shape)} (b t); pass it shaped like logprobs"
            )


def prepare_loss_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    is_weights: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(lp, old, adv, w)``: the ``(b t)`` inputs in float32, masked-out entries replaced by
    finite constants (module docstring: ``where`` before any arithmetic).

    ``lp`` keeps the gradient of ``logprobs`` (the ``where`` sends exactly 0 to masked
    entries); ``old``, ``adv`` and ``w`` are detached. Masked log-probs and advantages become
    0, masked weights 1; ``w`` is None when ``is_weights`` is.
    """
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    lp = torch.where(mask, logprobs.float(), zero)
    old = torch.where(mask, old_logprobs.detach().float(), zero)
    adv = torch.where(mask, advantages.detach().float(), zero)
    w = None if is_weights is None else torch.where(mask, is_weights.detach().float(), zero + 1)
    return lp, old, adv, w


def finish_loss(loss: Tensor, mask: Tensor, is_weights: Tensor | None) -> Tensor:
    """The per-token ``(b t)`` ``loss`` times the optional ``(b t)`` importance weights (as
    given: pass `prepare_loss_inputs`'s detached ``w``), zero where ``mask`` is False; the
    gradient flows through ``loss`` as it is."""
    if is_weights is not None:
        loss = loss * is_weights
    return torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def surrogate_terms(
    lp: Tensor,
    old: Tensor,
    adv: Tensor,
    *,
    clip: tuple[float, float],
    dual_clip: float | None,
    log_ratio_clamp: float,
) -> SurrogateTerms:
    """The clipped (and optionally dual-clipped) surrogate of `clipped_surrogate`'s equation on
    `prepare_loss_inputs`' ``(b t)`` float32 ``lp`` (with gradient), ``old`` and ``adv``
    (detached). Not yet weighted nor masked (`finish_loss`); ``ratio`` is detached, ``loss``
    and ``log_ratio`` carry the gradient of ``lp``."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(
            f"PolicyLoss: dual_clip must be > 1 (or None), got {dual_clip}; pass a value such "
            "as 3.0, or None for no dual clip"
        )
    eps_low, eps_high = clip
    log_ratio = (lp - old).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped_loss)  # the pessimistic (larger) loss
    clipped = clipped_loss > unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        negative = adv < 0
        dual_clipped = negative & (loss > cap)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    return SurrogateTerms(loss, log_ratio, ratio.detach(), clipped, dual_clipped)


def clip_metrics(terms: SurrogateTerms, mask: Tensor) -> dict[str, Tensor]:
    """Clip fractions over the valid tokens of ``mask`` ``(b t)``: ``clip_frac``, split by
    which side of 1 the ratio is on into ``clip_frac_low`` and ``clip_frac_high``, and
    ``dual_clip_frac``; detached float32 scalars."""
    with torch.no_grad():
        return {
            "clip_frac": masked_mean(terms.clipped, mask),
            "clip_frac_low": masked_mean(terms.clipped & (terms.ratio < 1.0), mask),
            "clip_frac_high": masked_mean(terms.clipped & (terms.ratio > 1.0), mask),
            "dual_clip_frac": masked_mean(terms.dual_clipped, mask),
        }


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max of ``values`` where ``mask`` (same shape, bool) is True, 0 when nothing counts: a
    float32 scalar, with no host sync. Gradient as ``max``'s; the metrics pass detached
    values."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=values.device)
    floor = torch.full((), float("-inf"), dtype=torch.float32, device=values.device)
    top = torch.where(mask, values.float(), floor).max()
    return torch.where(mask.any(), top, torch.zeros_like(top))


def ratio_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """k1 and k3 estimates of KL(π_old ‖ π_θ) and ratio statistics over valid tokens.

    ``log_ratio``: ``(b t)`` logπ_θ − logπ_old (already clamped by the caller; detached here);
    ``mask``: ``(b t)`` bool. With samples from π_old, k1 = −log r and k3 = r − 1 − log r
    (Schulman 2020, "Approximating KL divergence"). Returns detached float32 scalars
    ``approx_kl`` (k1), ``approx_kl_k3``, ``ratio_mean`` and ``ratio_max``.
    """
    with torch.no_grad():
        lr = log_ratio.detach().float()
        ratio = torch.exp(lr)
        return {
            "approx_kl": masked_mean(-lr, mask),
            "approx_kl_k3": masked_mean(ratio - 1.0 - lr, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": masked_max(ratio, mask),
        }


__all__ = [
    "SurrogateTerms",
    "check_loss_inputs",
    "clip_metrics",
    "clipped_surrogate",
    "finish_loss",
    "masked_max",
    "prepare_loss_inputs",
    "ratio_metrics",
    "surrogate_terms",
]
