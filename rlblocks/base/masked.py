"""Masked reductions shared by the advantage estimators, the losses and their metrics.

``mask`` is always bool and True means "this element counts". Every function here is
float32-safe: integer or low-precision inputs are reduced in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Σ values over the elements where ``mask`` is True (masked-out values, even NaN, are ignored)."""
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    picked = torch.where(mask, values, zeros)
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is True; 0 where nothing counts (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values.float(), mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over all elements where ``mask`` is True (a scalar).

    With ``unbiased`` the sum of squares is divided by n - 1 (Bessel); a single counted
    element has variance 0 rather than NaN.
    """
    values = values.float()
    mean = masked_mean(values, mask)
    count = mask.sum()
    sq = masked_sum((values - mean) ** 2, mask)
    denom = (count - 1) if unbiased else count
    return sq / denom.clamp(min=1)
