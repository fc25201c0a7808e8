"""Clip-Cov and KL-Cov: restrain the few tokens whose covariance drives entropy collapse.

Cui et al. 2025 show that under policy gradient the change of policy entropy is driven by the
covariance between a token's log-prob and its advantage, and that a small fraction of tokens
with a large positive covariance dominates it. Both losses rank tokens by the centred
per-token covariance over the valid tokens of the call::

    cov_t = (A_t − mean A) · (logπ_θ(y_t) − mean logπ_θ)      (means over valid tokens)

Simplifications and choices, stated once:

- The means and the number of selected tokens are taken over the tensors passed in, so with
  micro-batching the selection is per micro-batch (as in verl).
- Clip-Cov's random pick is a pure function of (``seed``, inputs): each token gets a 32-bit
  hash of (seed, its flat position, the bits of its ``old_logprobs``) and the eligible tokens
  with the smallest hashes are picked. No global RNG state is read or advanced, and the hash
  is exact integer arithmetic followed by a stable sort, so the pick does not depend on a
  device's random generator and is the same on every re-run. Pass a new ``seed`` each step
  (e.g. the step number) to decorrelate steps; the ``old_logprobs`` bits already make
  different batches pick differently under one seed.
- KL-Cov's top-k is deterministic; ties are broken by position (earlier first).
- **The one numeric difference from verl**: both losses clamp the log-ratio
  logπ_θ − logπ_old to ±``log_ratio_clamp`` (20) before ``exp``, like every other policy loss
  here (and verl's own ``compute_policy_loss_vanilla``). verl's ``compute_policy_loss_clip_cov``
  and ``compute_policy_loss_kl_cov`` do not clamp: ``ratio = exp(log_prob − old_log_prob)``.
  The two agree wherever |logπ_θ − logπ_old| ≤ 20; beyond it this ratio stays at e^±20 and the
  token's surrogate gets no gradient through the ratio, where verl's grows without bound (inf
  in float32 past a log-ratio of about 88.7). KL-Cov's |logπ_θ − logπ_old| penalty is not
  clamped, here or in verl. ``log_ratio_clamp=float("inf")`` gives verl's behaviour.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

from rlblocks.base.masked import masked_mean
from rlblocks.losses.names import LOSSES
from rlblocks.losses.ppo import (
    check_loss_inputs,
    clip_metrics,
    finish_loss,
    prepare_loss_inputs,
    ratio_metrics,
    surrogate_terms,
)

_MASK32 = 0xFFFFFFFF
_Int = TypeVar("_Int", Tensor, int)  # a Python int or an int64 tensor


@LOSSES.register("clip_cov")
def clip_cov(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    /,
    *,
    clip: tuple[float, float] = (0.2, 0.2),
    clip_ratio: float = 2e-4,
    cov_bounds: tuple[float, float] = (1.0, 5.0),
    seed: int = 0,
    dual_clip: float | None = None,
    log_ratio_clamp: float = 20.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token Clip-Cov loss: the PPO clipped surrogate with a few high-covariance tokens
    detached.

    ::

        ℓ_t     = clipped_surrogate_t                      (see ``clipped_surrogate``)
        E       = {t valid, not already clipped : ω_low ≤ cov_t ≤ ω_high}
        I_clip  = ⌊max(r·N, 1)⌋ tokens of E picked at random (all of E if it is smaller)
        loss_t  = sg[ℓ_t] if t ∈ I_clip else ℓ_t,   times w, 0 where masked

    N is the number of valid tokens, r = ``clip_ratio``, (ω_low, ω_high) = ``cov_bounds``.
    Picked tokens keep their loss value (for logging) but contribute no gradient; verl
    multiplies them by 0 instead, which gives the same gradient. Tokens the PPO clip (or dual
    clip) already cut off are not eligible, so each pick removes a live gradient.

    Reference: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv 2505.22617, Sec. 5 (Clip-Cov). Defaults r = 2e-4,
    (ω_low, ω_high) = (1, 5) as in the paper and verl ``compute_policy_loss_clip_cov`` (which,
    like this function, keeps the PPO clip and has no dual clip by default).

    Args:
        logprobs: ``(b t)`` log π_θ; the only input with a gradient; computed in float32.
        old_logprobs: ``(b t)`` log π_old; detached.
        advantages: ``(b t)`` float32; detached.
        mask: ``(b t)`` bool, True where the token counts.
        clip: PPO (ε_low, ε_high).
        clip_ratio: fraction r of valid tokens to detach (at least one when any is eligible).
        cov_bounds: (ω_low, ω_high), inclusive range of cov_t for eligible tokens.
        seed: makes the random pick reproducible; same inputs and seed give the same pick.
        dual_clip: dual-clip constant c > 1, or ``None`` (default) for none.
        log_ratio_clamp: bound on |logπ_θ − logπ_old| before ``exp``, as in the other losses;
            verl's ``compute_policy_loss_clip_cov`` has none (``float("inf")`` here). Past it
            a token's ratio is e^±20 and its surrogate has no gradient.
        is_weights: optional ``(b t)`` detached per-token weights multiplying the loss.

    Returns:
        ``loss`` ``(b t)`` float32, zero where ``mask`` is False, and detached float32 scalar
        ``metrics`` over valid tokens: ``clip_cov_frac`` (fraction detached), the PPO clip
        fractions (``clip_frac``, ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac``),
        ``approx_kl``, ``approx_kl_k3``, ``ratio_mean``, ``ratio_max``.
    """
    check_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    lp, old, adv, w = prepare_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    terms = surrogate_terms(
        lp, old, adv, clip=clip, dual_clip=dual_clip, log_ratio_clamp=log_ratio_clamp
    )
    with torch.no_grad():
        cov = _centered_cov(adv, lp.detach(), mask)
        low, high = cov_bounds
        eligible = mask & ~terms.clipped & ~terms.dual_clipped & (cov >= low) & (cov <= high)
        keys = _selection_keys(old, seed)  # int64 in [0, 2**32)
        keys = torch.where(eligible, keys, torch.full_like(keys, _MASK32 + 1))  # others last
        picked = eligible & (_ranks(keys, descending=False) < _pick_count(clip_ratio, mask))
    loss = finish_loss(torch.where(picked, terms.loss.detach(), terms.loss), mask, w)
    metrics = {
        "clip_cov_frac": masked_mean(picked, mask),
        **clip_metrics(terms, mask),
        **ratio_metrics(terms.log_ratio, mask),
    }
    return loss, metrics


@LOSSES.register("kl_cov")
def kl_cov(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    /,
    *,
    k_fraction: float = 2e-4,
    kl_coef: float = 1.0,
    log_ratio_clamp: float = 20.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token KL-Cov loss: the unclipped surrogate plus a KL penalty on the top-covariance
    tokens.

    With r_t = exp(clamp(logπ_θ − logπ_old, ±log_ratio_clamp))::

        I_KL    = the ⌊max(k·N, 1)⌋ valid tokens with the largest cov_t
        loss_t  = −A_t·r_t + β·|logπ_θ(y_t) − logπ_old(y_t)|·[t ∈ I_KL],   times w, 0 where masked

    N is the number of valid tokens, k = ``k_fraction`` (a fraction: 2e-4 is 0.02 %),
    β = ``kl_coef``. There is no PPO clip: the KL term on the few tokens that drive entropy
    down is the whole regulariser.

    Reference: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv 2505.22617, Sec. 5 (KL-Cov). Defaults k = 2e-4 and β = 1 as in verl
    ``compute_policy_loss_kl_cov`` (the paper uses k = 2e-3 for its 7B model and 2e-4 for 32B).

    Args:
        logprobs: ``(b t)`` log π_θ; the only input with a gradient; computed in float32.
        old_logprobs: ``(b t)`` log π_old; detached.
        advantages: ``(b t)`` float32; detached.
        mask: ``(b t)`` bool, True where the token counts.
        k_fraction: fraction k of valid tokens that get the KL penalty (at least one).
        kl_coef: β, the weight of |logπ_θ − logπ_old| on the selected tokens.
        log_ratio_clamp: bound on |logπ_θ − logπ_old| before ``exp`` (the KL term is not
            clamped), as in the other losses; verl's ``compute_policy_loss_kl_cov`` has none
            (``float("inf")`` here). Past it a token's −A·r term has no gradient.
        is_weights: optional ``(b t)`` detached per-token weights multiplying the loss.

    Returns:
        ``loss`` ``(b t)`` float32, zero where ``mask`` is False, and detached float32 scalar
        ``metrics`` over valid tokens: ``kl_cov_frac`` (fraction penalised), ``abs_kl`` (mean
        |logπ_θ − logπ_old|), ``approx_kl``, ``approx_kl_k3``, ``ratio_mean``, ``ratio_max``.
    """
    check_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    lp, old, adv, w = prepare_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights)
    log_ratio = (lp - old).clamp(-log_ratio_clamp, log_ratio_clamp)
    abs_kl = (lp - old).abs()
    with torch.no_grad():
        cov = _centered_cov(adv, lp.detach(), mask)  # −inf where masked: ranked last
        picked = mask & (_ranks(cov, descending=True) < _pick_count(k_fraction, mask))
    penalty = torch.where(picked, kl_coef * abs_kl, torch.zeros_like(abs_kl))
    loss = finish_loss(-adv * torch.exp(log_ratio) + penalty, mask, w)
    with torch.no_grad():
        metrics = {
            "kl_cov_frac": masked_mean(picked, mask),
            "abs_kl": masked_mean(abs_kl, mask),
            **ratio_metrics(log_ratio, mask),
        }
    return loss, metrics


def _centered_cov(adv: Tensor, lp: Tensor, mask: Tensor) -> Tensor:
    """(A − mean A)·(logπ − mean logπ) per token, means over valid tokens; −inf where masked."""
    cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp, mask))
    return torch.where(mask, cov, torch.full_like(cov, float("-inf")))


def _pick_count(fraction: float, mask: Tensor) -> Tensor:
    """⌊max(fraction·N, 1)⌋ with N valid tokens, as a tensor (no host sync); float64 so the
    floor matches Python's ``int(fraction * N)``."""
    return torch.floor(mask.sum().double() * fraction).clamp(min=1)


def _ranks(keys: Tensor, *, descending: bool) -> Tensor:
    """Rank of every element of ``keys`` in a stable sort of the flattened tensor (0 = first)."""
    flat = keys.reshape(-1)
    order = torch.argsort(flat, descending=descending, stable=True)
    positions = torch.arange(flat.numel(), device=keys.device)
    ranks = torch.empty_like(order).scatter_(0, order, positions)
    return ranks.view(keys.shape)


def _mix32(x: _Int) -> _Int:
    """A 32-bit integer hash (xor-shift-multiply), for Python ints or int64 tensors in
    [0, 2**32). The multiplier is below 2**27, so int64 products never overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _selection_keys(old_logprobs: Tensor, seed: int) -> Tensor:
    """Per-token pseudo-random keys in [0, 2**32), a function of (seed, position, old bits)."""
    seed_hash = _mix32((seed ^ (seed >> 32)) & _MASK32)
    bits = old_logprobs.float().contiguous().view(torch.int32).long() & _MASK32
    position = torch.arange(bits.numel(), device=bits.device).view(bits.shape) & _MASK32
    return _mix32(_mix32(_mix32(position) ^ seed_hash) ^ bits)
