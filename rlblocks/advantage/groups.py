"""Statistics over groups of rows that share a prompt, for arbitrary int64 group ids.

Ids need not be contiguous, sorted or start at 0: ``torch.unique(return_inverse=True)`` maps
them to ``0..n_groups-1`` and the reductions are ``index_add`` / ``scatter_reduce`` over that
index. Every function returns the group statistic *broadcast back to the rows*, a ``(b)``
tensor, because that is what the estimators consume. They work in float32, or in float64 when
given float64 values (`_floating`): an estimator whose statistics may overflow float32 (squares
of rewards past ~1.8e19) passes float64.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Dense index ``(b)`` int64 in ``0..n-1`` for arbitrary ``group_ids`` ``(b)``, and ``n``."""
    if group_ids.dim() != 1:
        raise ValueError(
            f"AdvantageEstimator: group_ids must be (b), got shape {tuple(group_ids.shape)}; "
            "pass one group id per row"
        )
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def warn_if_no_group(group_ids: Tensor, *, estimator: str) -> None:
    """Warn (at every call, through ``logging``) when every group has one row: a group-relative
    advantage is then 0 for every row and the update learns nothing. The usual causes: one
    sample per prompt (``n=1``, a recipe's ``group_size=1``), or group ids made unique by hand."""
    b = group_ids.numel()
    if b > 1 and group_index(group_ids)[1] == b:
        logger.warning(
            "%s: every group has one row (%d rows, %d distinct group ids), so every "
            "group-relative advantage is 0 and nothing is learnt; sample several responses "
            "per prompt (group_size=G with G >= 2, in engine.generate or a recipe) and give the "
            "rows of one prompt one group id",
            estimator, b, b,
        )  # fmt: skip


def _floating(values: Tensor) -> Tensor:
    """``values`` as float64 if they are, else float32: the dtype the statistics are taken in."""
    return values if values.dtype == torch.float64 else values.float()


def group_size(group_ids: Tensor) -> Tensor:
    """Number of rows in each row's group, ``(b)`` int64."""
    index, n = group_index(group_ids)
    counts = torch.zeros(n, dtype=torch.int64, device=group_ids.device)
    counts.index_add_(0, index, torch.ones_like(index))
    return counts[index]


def group_sum(values: Tensor, group_ids: Tensor) -> Tensor:
    """Σ of ``values`` ``(b)`` over each row's group, ``(b)`` float32 (float64 for float64)."""
    index, n = group_index(group_ids)
    values = _floating(values)
    sums = torch.zeros(n, dtype=values.dtype, device=values.device)
    sums.index_add_(0, index, values)
    return sums[index]


def group_mean(values: Tensor, group_ids: Tensor, *, weights: Tensor | None = None) -> Tensor:
    """Mean of ``values`` ``(b)`` over each row's group, ``(b)`` float32.

    With ``weights`` ``(b)`` it is the weighted mean Σ w·x / Σ w; a group whose weights sum to
    0 gets the plain mean instead (there is no weighted mean to take).

    The mean is taken of the deviations from the group's maximum, then shifted back: a group
    of equal values then has exactly that value as its mean (a plain float32 Σx / n of equal
    values can miss it by an ulp, which a division by a tiny std would blow up).
    """
    values = _floating(values)
    anchor = group_max(values, group_ids)
    offsets = values - anchor
    plain = group_sum(offsets, group_ids) / group_size(group_ids)
    if weights is not None:
        weights = weights.to(values.dtype)
        total = group_sum(weights, group_ids)
        weighted = group_sum(weights * offsets, group_ids) / torch.where(total == 0, 1.0, total)
        plain = torch.where(total == 0, plain, weighted)
    return anchor + plain


def group_std(values: Tensor, group_ids: Tensor, *, unbiased: bool = True) -> Tensor:
    """Standard deviation of ``values`` ``(b)`` within each row's group, ``(b)`` float32.

    ``unbiased`` divides by n - 1 (Bessel, like ``torch.std``); a group of one has std 0.
    Two passes (mean first, then squared deviations) for accuracy.
    """
    values = _floating(values)
    size = group_size(group_ids)
    sq = group_sum((values - group_mean(values, group_ids)) ** 2, group_ids)
    denom = (size - 1 if unbiased else size).clamp(min=1)
    return (sq / denom).sqrt()


def group_max(values: Tensor, group_ids: Tensor) -> Tensor:
    """Largest of ``values`` ``(b)`` in each row's group, ``(b)`` float32."""
    return _group_reduce(values, group_ids, "amax")


def group_min(values: Tensor, group_ids: Tensor) -> Tensor:
    """Smallest of ``values`` ``(b)`` in each row's group, ``(b)`` float32."""
    return _group_reduce(values, group_ids, "amin")


def _group_reduce(values: Tensor, group_ids: Tensor, reduce: str) -> Tensor:
    index, n = group_index(group_ids)
    values = _floating(values)
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    out = out.scatter_reduce(0, index, values, reduce=reduce, include_self=False)
    return out[index]
