"""Splitting a batch across data-parallel ranks: balanced by tokens, gathered back in order.

The cost of a forward/backward pass grows with the number of real tokens of its rows, not with
the number of rows, so a worker group hands each rank about the same number of tokens. The
split is the classic longest-processing-time rule (Graham 1969, "Bounds on multiprocessing
timing anomalies"): rows in decreasing length, each to the rank with the fewest tokens so far.
Its largest load is at most 4/3 of the best possible one, and always within one row's length
of the smallest load. verl balances sequence lengths across ranks the same way in spirit
(``get_seqlen_balanced_partitions``, a Karmarkar-Karp split); LPT is simpler and close enough.

Each rank keeps its rows in their original order, so gathering is a single inverse permutation.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from torch import Tensor


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices for each of ``parts`` ranks, every list sorted, balanced by ``lengths``.

    Every rank gets at least one row when there are at least ``parts`` rows. Ties go to the
    lower rank and to the earlier row, so the split is deterministic.
    """
    if parts < 1:
        raise ValueError(f"balanced_partition: parts must be >= 1, got {parts}")
    loads = [(0, rank) for rank in range(parts)]  # (tokens so far, rank): a min-heap
    heapq.heapify(loads)
    out: list[list[int]] = [[] for _ in range(parts)]
    # Longest first; among equal lengths, earlier rows first.
    for row in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        load, rank = heapq.heappop(loads)
        out[rank].append(row)
        heapq.heappush(loads, (load + int(lengths[row]), rank))
    return [sorted(rows) for rows in out]


def contiguous_partition(n: int, parts: int) -> list[list[int]]:
    """``range(n)`` cut into ``parts`` consecutive pieces whose sizes differ by at most one."""
    if parts < 1:
        raise ValueError(f"contiguous_partition: parts must be >= 1, got {parts}")
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
