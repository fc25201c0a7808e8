"""Padding-free trainer forwards: a ``Rollouts`` micro-batch as one packed sequence.

:func:`pack` lays the real tokens of a batch out as :class:`~rlblocks.models.packing.Packed`;
``rlblocks.models.packing`` runs the model over it with attention kept within each row
(:func:`kept_apart`, :func:`packed_attention`, :func:`check_isolation` are re-exported here).
"""

from __future__ import annotations

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


__all__ = ["Packed", "attention_path", "check_isolation", "kept_apart", "pack", "packed_attention"]
