"""Causal attention within packed rows by torch's variable-length flash kernel (CUDA).

``torch.nn.attention.varlen.varlen_attn`` takes the packed ``(n h d)`` queries, keys and
values with the rows' cumulative lengths and computes Σ len_i² per head, with no padding and
one kernel per layer: what the flash-attention library's ``flash_attn_varlen_func`` does, in
torch itself (2.10 and later, CUDA, fp16/bf16). ``rlblocks.models.packing.attend_rows`` uses it
on a GPU when it is there; elsewhere the rows are padded inside the attention instead.

Its signature moved between torch releases (``is_causal=True`` in the first, a
``window_size=(-1, 0)`` after); :func:`kernel` reads it once and returns None when it knows
neither, so an unknown torch falls back to the padded path instead of failing.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

_cache = threading.local()  # the last rows' cumulative lengths on a device


@functools.cache
def kernel() -> tuple[Callable[..., Any], dict[str, Any], bool] | None:
    """``(varlen_attn, its causal keywords, whether it takes enable_gqa)``, or None when this
    torch has no variable-length kernel or one whose causal argument is unknown."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    try:
        names = set(inspect.signature(varlen_attn).parameters)
    except (TypeError, ValueError):
        return None
    if "window_size" in names:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in names:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in names


def serves(query: Tensor) -> bool:
    """True when :func:`attend` can run on ``query``: CUDA, fp16 or bf16, a kernel found."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and kernel() is not None


def attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bounds: tuple[tuple[int, int], ...],
    *,
    scale: float | None = None,
) -> Tensor:
    """Causal attention within each row ``[start, end)`` of ``bounds`` (covering ``[0, n)`` in
    order): ``query`` ``(1 h n d)``, ``key``/``value`` ``(1 h_kv n d)``; returns ``(1 h n d)``.
    Only where :func:`serves` says so."""
    found = kernel()
    assert found is not None  # serves() was asked first
    varlen_attn, causal, takes_gqa = found
    cu, longest = _cumulative(bounds, query.device)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (n h d)
    groups = q.shape[1] // k.shape[1]
    options: dict[str, Any] = dict(causal)
    if groups > 1:
        if takes_gqa:
            options["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest,
                      scale=scale, **options)  # fmt: skip
    return out.transpose(0, 1)[None]


def _cumulative(bounds: tuple[tuple[int, int], ...], device: torch.device) -> tuple[Tensor, int]:
    """The rows' cumulative lengths ``(r + 1)`` int32 on ``device`` and the longest row; kept
    for the last bounds seen (every layer of a forward asks for the same)."""
    cached = getattr(_cache, "last", None)
    if cached is not None and cached[0] == bounds and cached[1] == device:
        return cached[2], cached[3]
    edges = [0, *(end for _, end in bounds)]
    cu = torch.tensor(edges, dtype=torch.int32).to(device, non_blocking=True)
    longest = max((end - start for start, end in bounds), default=0)
    _cache.last = (bounds, device, cu, longest)
    return cu, longest
