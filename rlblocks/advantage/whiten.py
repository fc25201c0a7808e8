"""Batch whitening of per-token values over the valid tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.base.masked import masked_mean, masked_var


@torch.no_grad()
def whiten(
    values: Tensor, mask: Tensor, /, *, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Standardize ``values`` with the mean and variance of all valid tokens of the batch.

        μ = mean_{mask} x,   σ² = Σ_{mask} (x − μ)² / (N − 1),   x̂ = (x − μ) / √(σ² + eps)

    and with ``shift_mean=False`` the mean is kept: x̂ = (x − μ) / √(σ² + eps) + μ (only the spread
    is normalized, as in verl's and TRL's ``masked_whiten``). The variance is the unbiased (Bessel)
    one, like theirs; N is the number of valid tokens. With fewer than two valid tokens σ² = 0.

    Args:
        values: ``(b t)`` any float dtype (or ``(b)``: any shape equal to ``mask``'s works).
        mask: same shape as ``values``, bool; only True elements enter μ and σ².

    Returns:
        ``(b t)`` float32, zero where ``mask`` is False; no gradient (runs under ``no_grad``).
        ``values`` is not modified.
    """
    if values.shape != mask.shape:
        raise ValueError(
            f"whiten: values {tuple(values.shape)} and mask {tuple(mask.shape)} differ; pass "
            "values shaped like mask"
        )
    values = values.float()
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, 0.0)
