"""The row and padding work of `rlblocks.rollouts.Rollouts` that needs no batch: ragged token
lists padded into tensors (prompts on the left, responses on the right), padded tensors widened
and joined, row indices checked, and rows shared out over workers by their lengths.

Kept out of ``rlblocks/rollouts.py`` so that the batch type reads as its fields and their
operations. A base module: it imports nothing of rlblocks; `rlblocks.rollouts` imports it
(and re-exports `balanced_partition`), never the other way.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any, TypedDict

import torch
from torch import Tensor

__all__ = [
    "PaddedLists",
    "balanced_partition",
    "cat_padded",
    "pad_columns",
    "padded_lists",
    "ragged_tensor",
    "row_index",
]


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices for each of ``parts`` workers, every list sorted, balanced by ``lengths``.

    The cost of a forward/backward pass grows with a row's real tokens, so each worker should get
    about the same number of tokens. Longest processing time first (Graham 1969, "Bounds on
    multiprocessing timing anomalies"): rows in decreasing length, each to the worker with the
    fewest tokens so far; the largest load is at most 4/3 of the best possible one. (verl's
    ``get_seqlen_balanced_partitions`` is a Karmarkar-Karp split; LPT is simpler and close.)
    Every worker gets a row when there are at least ``parts`` rows; ties go to the lower
    worker and the earlier row, so the split is deterministic.
    """
    if parts < 1:
        raise ValueError(f"balanced_partition: parts={parts}; use parts >= 1")
    loads = [(0, rank) for rank in range(parts)]  # (tokens so far, rank): a min-heap
    out: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        load, rank = heapq.heappop(loads)
        out[rank].append(row)
        heapq.heappush(loads, (load + int(lengths[row]), rank))
    return [sorted(rows) for rows in out]


def row_index(index: Tensor | Sequence[int], b: int) -> tuple[Tensor, list[int]]:
    """The rows of a batch of ``b`` that a bool mask (b) or a list/tensor of indices (any
    order, negative ones counted from the end) picks, as a (k) int64 index tensor on the
    index's device and as a list of ints in 0..b-1 (read once). ``Rollouts.select``'s check."""
    rows = torch.as_tensor(index)
    if rows.dtype == torch.bool:
        if rows.shape != (b,):
            raise ValueError(
                f"Rollouts.select: bool mask has shape {tuple(rows.shape)}, expected ({b},); "
                "pass one bool per row"
            )
        rows = rows.nonzero().flatten()
    values = rows.long().flatten().tolist()  # one read: the range check and the rows' lists
    if values and (min(values) < -b or max(values) >= b):
        raise IndexError(
            f"Rollouts.select: row index out of range for a batch of {b}; pass indices in "
            f"{-b}..{b - 1}"
        )
    picked = [v % b for v in values]
    return torch.tensor(picked, dtype=torch.long, device=rows.device), picked


def pad_columns(x: Tensor, width: int, left: bool, value: float | bool) -> Tensor:
    """``x`` (b w ...) padded with ``value`` to (b width ...) on the ``left`` or the right; a
    1-D tensor (one value per row) as it is."""
    if x.dim() == 1 or x.shape[1] == width:
        return x
    filler = torch.full((x.shape[0], width - x.shape[1], *x.shape[2:]), value, dtype=x.dtype)
    filler = filler.to(x.device)
    return torch.cat([filler, x] if left else [x, filler], dim=1)


def cat_padded(tensors: Sequence[Tensor], width: int, left: bool, value: float | bool) -> Tensor:
    """The rows of ``tensors``, each padded to ``width`` columns by `pad_columns`, in order."""
    return torch.cat([pad_columns(x, width, left, value) for x in tensors])


def ragged_tensor(
    rows: Sequence[Sequence[Any]], width: int, left: bool, value: Any, dtype: torch.dtype
) -> Tensor:
    """A (len(rows) width) tensor of ``dtype``: each row's entries on the ``left`` or the
    right, ``value`` elsewhere."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            target = out[i, width - len(row) :] if left else out[i, : len(row)]
            target.copy_(torch.as_tensor(list(row), dtype=dtype))
    return out


class PaddedLists(TypedDict):
    """The token fields of `padded_lists`, by the names of ``Rollouts``' fields."""

    prompt_ids: Tensor
    response_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor | None


def padded_lists(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    response_masks: Sequence[Sequence[bool]] | None,
    rollout_logprobs: Sequence[Sequence[float]] | None,
) -> PaddedLists:
    """``Rollouts.from_lists``' token fields: ``prompt_ids`` (b tp) left-padded,
    ``response_ids`` (b t) right-padded, ``attention_mask`` (b tp+t), ``response_mask``
    (b t; every response token when ``response_masks`` is None) and ``rollout_logprobs``
    (b t) float32 or None, after checking that the lists line up."""
    b = len(prompt_ids)
    if len(response_ids) != b:
        raise ValueError(
            f"Rollouts.from_lists: {b} prompts but {len(response_ids)} responses; pass one "
            "response per prompt"
        )
    masks = response_masks or [[True] * len(r) for r in response_ids]
    for name, ragged in (("response_masks", masks), ("rollout_logprobs", rollout_logprobs)):
        if ragged is None:
            continue
        for i, (r, m) in enumerate(zip(response_ids, ragged, strict=True)):
            if len(r) != len(m):
                raise ValueError(
                    f"Rollouts.from_lists: row {i} has {len(r)} response tokens but {name} "
                    f"has {len(m)} entries; give one entry per response token"
                )
    tp = max((len(p) for p in prompt_ids), default=0)
    t = max((len(r) for r in response_ids), default=0)
    attention = torch.cat(
        [
            ragged_tensor([[True] * len(p) for p in prompt_ids], tp, True, False, torch.bool),
            ragged_tensor([[True] * len(r) for r in response_ids], t, False, False, torch.bool),
        ],
        dim=1,
    )
    return {
        "prompt_ids": ragged_tensor(prompt_ids, tp, True, pad_token_id, torch.long),
        "response_ids": ragged_tensor(response_ids, t, False, pad_token_id, torch.long),
        "attention_mask": attention,
        "response_mask": ragged_tensor(masks, t, False, False, torch.bool),
        "rollout_logprobs": None
        if rollout_logprobs is None
        else ragged_tensor(rollout_logprobs, t, False, 0.0, torch.float32),
    }
