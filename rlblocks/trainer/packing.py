"""Padding-free trainer forwards: a ``Rollouts`` micro-batch as one packed sequence.

:func:`pack` lays the real tokens of a batch out as :class:`~rlblocks.models.packing.Packed`;
``rlblocks.models.packing`` runs the model over it with attention kept within each row
(:func:`kept_apart`, :func:`packed_attention`, :func:`check_isolation` are re-exported here).
"""

from __future__ import annotations

import itertools

import torch

from rlblocks.models.packing import (
    Packed,
    attention_path,
    check_isolation,
    kept_apart,
    packed_attention,
)
from rlblocks.rollouts import Rollouts


def pack(rollouts: Rollouts) -> Packed:
    """:class:`Packed` of ``rollouts``: every real token (``attention_mask``) in row-major
    order. A row's real tokens keep their order and get positions 0, 1, … (as
    ``position_ids(attention_mask)`` gives them in the padded layout), so a row scores the
    same packed or padded. Rows need a real prompt token (the first response token is
    predicted from the last prompt token)."""
    kept = rollouts.known_lengths()
    if kept is not None:
        return _pack_runs(rollouts, *kept)
    mask = rollouts.attention_mask.bool()
    b, t = rollouts.response_ids.shape
    tp = rollouts.prompt_ids.shape[1]
    lengths = mask.sum(-1)
    no_prompt = (~rollouts.prompt_mask.bool().any(-1)).nonzero()
    if len(no_prompt):
        row = int(no_prompt[0])
        raise ValueError(
            f"pack: row {row} has no real prompt token; give every row at least one prompt "
            "token (its first response token is predicted from the last one)"
        )
    flat = mask.flatten()
    index = (flat.long().cumsum(0) - 1).view(b, tp + t)  # packed position of each real token
    ends = lengths.cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    positions = (mask.long().cumsum(-1) - 1)[mask]
    real = rollouts.response_attention_mask.bool()
    rows, cols = real.nonzero(as_tuple=True)
    keep = index[:, tp:][rows, cols] - 1
    return Packed(
        input_ids=rollouts.input_ids[mask][None],
        position_ids=positions[None],
        bounds=tuple(zip(starts, ends, strict=True)),
        keep=keep,
        targets=rollouts.response_ids[rows, cols],
        rows=rows,
        cols=cols,
        shape=(b, t),
    )


def _pack_runs(rollouts: Rollouts, prompt: list[int], response: list[int]) -> Packed:
    """:func:`pack` of rows whose real tokens are one run each (``Rollouts.known_lengths``):
    every index is built on the host from those lengths, so packing reads nothing back."""
    b, t = rollouts.response_ids.shape
    tp = rollouts.prompt_ids.shape[1]
    if 0 in prompt:
        raise ValueError(
            f"pack: row {prompt.index(0)} has no real prompt token; give every row at least one "
            "prompt token (its first response token is predicted from the last one)"
        )
    lengths = [p + r for p, r in zip(prompt, response, strict=True)]
    ends = list(itertools.accumulate(lengths))
    starts = [0, *ends[:-1]]
    n, m = (ends[-1] if ends else 0), sum(response)
    # Packed position j of row i holds column (tp − prompt_i) + (j − start_i) of the row.
    row_of_token = torch.repeat_interleave(torch.arange(b), torch.tensor(lengths), output_size=n)
    offset = torch.tensor(
        [s - (tp - p) - i * (tp + t) for i, (s, p) in enumerate(zip(starts, prompt, strict=True))]
    )
    flat = torch.arange(n) - offset[row_of_token]  # position in the flattened (b, tp + t) rows
    positions = torch.arange(n) - torch.tensor(starts, dtype=torch.long)[row_of_token]
    rows = torch.repeat_interleave(torch.arange(b), torch.tensor(response), output_size=m)
    first = torch.tensor(list(itertools.accumulate([0, *response[:-1]])), dtype=torch.long)
    cols = torch.arange(m) - first[rows]
    keep = torch.tensor(starts, dtype=torch.long)[rows] + torch.tensor(prompt)[rows] + cols - 1
    device = rollouts.response_ids.device
    rows, cols = rows.to(device), cols.to(device)
    return Packed(
        input_ids=rollouts.input_ids.flatten()[flat.to(device)][None],
        position_ids=positions.to(device)[None],
        bounds=tuple(zip(starts, ends, strict=True)),
        keep=keep.to(device),
        targets=rollouts.response_ids[rows, cols],
        rows=rows,
        cols=cols,
        shape=(b, t),
    )


__all__ = ["Packed", "attention_path", "check_isolation", "kept_apart", "pack", "packed_attention"]
