"""Scattering a call's arguments over the workers of a group, and gathering the answers.

How each method is split is declared with ``rlblocks.interfaces.dispatch``: the rows of a
``Rollouts`` go to the workers balanced by tokens (``Rollouts.balanced_shares``), prompts in
contiguous pieces (:func:`contiguous_partition`). Each worker keeps its rows in their original
order, so gathering is a single inverse permutation (:func:`gather_rows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlblocks.interfaces import SamplingParams
from rlblocks.rollouts import Rollouts


def contiguous_partition(n: int, parts: int) -> list[list[int]]:
    """``range(n)`` cut into ``parts`` consecutive pieces whose sizes differ by at most one."""
    if parts < 1:
        raise ValueError(
            f"contiguous_partition: parts must be >= 1, got {parts}; pass a positive count"
        )
    base, extra = divmod(n, parts)
    out, start = [], 0
    for rank in range(parts):
        size = base + (rank < extra)
        out.append(list(range(start, start + size)))
        start += size
    return out


def gather_rows(parts: Sequence[Tensor], index: Sequence[Sequence[int]], n: int) -> Tensor:
    """Put each rank's rows (``parts[r][k]`` is row ``index[r][k]``) back into one ``(n ...)``.

    Rows that appear in no index stay zero; rows listed twice (padding copies) take the value of
    their first listing.
    """
    first = next(p for p in parts if p is not None)
    out = first.new_zeros((n, *first.shape[1:]))
    seen = torch.zeros(n, dtype=torch.bool)
    for part, rows in zip(parts, index, strict=True):
        for k, row in enumerate(rows):
            if not seen[row]:
                out[row] = part[k]
                seen[row] = True
    return out


def take_rows(value: Any, rows: list[int], b: int) -> Any:
    """The rows of a per-row argument (``Rollouts``, ``(b …)`` tensors); anything else as is."""
    if isinstance(value, Rollouts):
        return value.to("cpu").select(rows)
    if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == b:
        return value.detach().cpu()[rows]
    return value


def gather_answers(answers: list, index: list[list[int]], b: int, weights: list[int]) -> Any:
    """One answer from the workers' answers to their rows: tensors (and tuples of them) back in
    row order, dicts of numbers averaged weighted by ``weights`` (real rows), else the first."""
    first = answers[0]
    if isinstance(first, Tensor) and first.dim() >= 1:
        return gather_rows(answers, index, b)
    if isinstance(first, tuple):
        fields = [
            gather_answers([a[i] for a in answers], index, b, weights) for i in range(len(first))
        ]
        return type(first)(*fields) if hasattr(first, "_fields") else tuple(fields)
    if isinstance(first, dict) and all(isinstance(v, int | float) for v in first.values()):
        total = sum(weights)
        return {
            k: sum(w * a[k] for w, a in zip(weights, answers, strict=True)) / total for k in first
        }
    return first


def rank_seed(sampling: Any, rank: int) -> Any:
    """With a seed, rank r samples with ``seed + r`` (one seed would give every rank the same
    noise); ``sampling`` as it is otherwise."""
    if not isinstance(sampling, SamplingParams) or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + rank)
