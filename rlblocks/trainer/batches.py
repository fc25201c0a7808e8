"""Row bookkeeping of a policy update: mini-batch order, advantage shapes, re-padding.

Kept apart from the trainer so that each piece is a small pure function with its own test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from rlblocks.rollouts import Rollouts
from rlblocks.trainer.config import TrainConfig

if TYPE_CHECKING:
    from rlblocks.trainer.parallel import DataParallel, SingleProcess


def minibatch_rows(
    b: int, *, size: int | None, epochs: int, seed: tuple[int, ...]
) -> Iterator[Tensor]:
    """Row indices of each mini-batch, epoch after epoch.

    With several mini-batches per epoch (``size < b``), every epoch is a fresh permutation of
    ``range(b)`` cut into ⌈b / size⌉ consecutive pieces (the last may be smaller). With one
    (``size`` None or ≥ b) the rows stay in order: permuting the rows of a single mini-batch
    would change nothing but the summation order. A call yields ``epochs · ⌈b / size⌉`` int64
    ``(rows)`` tensors. Permutations come from a private generator seeded by ``seed`` (a tuple
    of ints), never from the global RNG: the same seed gives the same order, whatever else
    consumed random numbers.
    """
    generator = torch.Generator().manual_seed(_seed(seed))
    for _ in range(epochs):
        if size is None or size >= b:
            yield torch.arange(b)
        else:
            yield from torch.randperm(b, generator=generator).split(size)


def _seed(values: tuple[int, ...]) -> int:
    # A fixed 64-bit mix (not Python's hash, which is salted for strings): splitmix64 steps.
    state = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    for value in values:
        state = (state ^ (value & mask)) * 0xBF58476D1CE4E5B9 & mask
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & mask
        state ^= state >> 31
    return state & ((1 << 63) - 1)


def token_advantages(advantages: Tensor | tuple[Tensor, ...], rollouts: Rollouts) -> Tensor:
    """Advantages as ``(b t)`` float32, zero where ``response_mask`` is False, detached.

    Accepts an ``Advantages`` tuple (its first field), a ``(b t)`` tensor, or a ``(b)`` tensor of
    one advantage per sequence, broadcast to every token of the row: A_{i,k} = A_i · m_{i,k}.
    """
    if isinstance(advantages, tuple):
        advantages = advantages[0]
    b, t = rollouts.response_ids.shape
    adv = advantages.detach().to(device=rollouts.response_ids.device, dtype=torch.float32)
    if adv.shape == (b,):
        adv = adv[:, None].expand(b, t)
    if adv.shape != (b, t):
        raise ValueError(
            f"PolicyTrainer.step: advantages have shape {tuple(adv.shape)}, expected ({b}, {t}) "
            f"or ({b},); pass one advantage per response token or per row"
        )
    mask = rollouts.response_mask
    if b == t and b > 1 and _transposed(adv, mask):
        raise ValueError(
            f"PolicyTrainer.step: advantages look transposed: ({b}, {t}) values that are 0 "
            "wherever response_mask.T "
            "is False but not wherever response_mask is; pass them as (b t), rows first, as "
            "the rb.advantage estimators return them"
        )
    return torch.where(mask, adv, torch.zeros((), device=adv.device))


def _transposed(adv: Tensor, mask: Tensor) -> bool:
    """Per-token advantages from an estimator are 0 outside the response mask; a square batch
    (b = t) passed as (t b) is 0 outside the mask's transpose instead."""
    return bool((adv[~mask] != 0).any()) and not bool((adv.T[~mask] != 0).any())


def pad_columns(x: Tensor, width: int) -> Tensor:
    """Right-pad ``(b t')`` to ``(b width)`` with zeros (undoes ``Rollouts.trim`` of responses)."""
    return F.pad(x, (0, width - x.shape[1]))


def micro_batch_pairs(
    rollouts: Rollouts, config: TrainConfig, dp: SingleProcess | DataParallel
) -> tuple[list[tuple[Rollouts, bool]], Tensor | None]:
    """``(micro_batch, real)`` pairs of :func:`micro_batches`, and the row order they follow
    (None: the batch's own). In a data-parallel group every rank pads its list to the longest
    with ``real=False`` copies of its first row, which run (FSDP's collectives must match) and
    count for nothing. A rank needs at least one row."""
    parts, order = micro_batches(rollouts, config)
    if dp.size == 1:
        return [(p, True) for p in parts], order
    if len(rollouts) == 0:
        raise ValueError(
            "PolicyTrainer.step: this data-parallel rank got no row; give every rank at least "
            "one row (bigger batches or fewer workers)"
        )
    return dp.aligned(parts, filler=rollouts.select([0])), order


def micro_batches(rollouts: Rollouts, config: TrainConfig) -> tuple[list[Rollouts], Tensor | None]:
    """The forward/backward pieces of a batch: by ``micro_batch_size`` rows and/or
    ``micro_batch_tokens`` real tokens; the whole batch when neither is set.

    Pieces are cut from the rows sorted by length (:func:`length_order`, returned as the second
    value; None for the whole batch in one piece), so each holds rows of similar length and
    ``Rollouts.trim`` leaves little padding to compute: with responses of 3 to 32 tokens, a
    piece of the 8 shortest rows no longer runs 32 columns for each. The order of the rows
    changes no gradient (the pieces' losses add up to the mini-batch's), only the rounding.
    Scores computed piece by piece go back to the batch's order with :func:`in_batch_order`.
    """
    rows, tokens = config.micro_batch_size, config.micro_batch_tokens
    if rows is None and tokens is None:
        return [rollouts], None
    if tokens is not None:
        check_token_budget(rollouts, tokens)
    order = length_order(rollouts)
    return rollouts.select(order).split(rows=rows, token_budget=tokens), order


def check_token_budget(rollouts: Rollouts, budget: int) -> None:
    """Refuse a row with more real tokens (prompt + response) than ``budget``, the
    ``micro_batch_tokens`` every forward is sized for, naming the longest such row."""
    lengths = rollouts.row_tokens()
    longest = max(lengths, default=0)
    if longest > budget:
        row = lengths.index(longest)
        raise ValueError(
            f"TrainConfig.micro_batch_tokens: row {row} has {longest} tokens (prompt + "
            f"response), more than the budget of {budget} per forward; raise "
            f"micro_batch_tokens to at least {longest}, or cut the rows shorter "
            "(max_new_tokens, prompt length)"
        )


def length_order(rollouts: Rollouts) -> Tensor:
    """Row indices sorted by response length, then prompt length (stable: ties keep order)."""
    kept = rollouts.known_lengths()
    if kept is not None:  # on the host already: no read
        prompt_lengths, response_lengths = kept
        order = sorted(range(len(rollouts)), key=lambda i: (response_lengths[i], prompt_lengths[i]))
        return torch.tensor(order, dtype=torch.long)
    response = rollouts.response_attention_mask.sum(-1)
    prompt = rollouts.prompt_mask.sum(-1)
    key = response * (rollouts.prompt_ids.shape[1] + 1) + prompt
    return torch.sort(key.cpu(), stable=True).indices


def in_batch_order(x: Tensor, order: Tensor | None) -> Tensor:
    """``x``, whose rows follow ``order`` (from :func:`micro_batches`), in the batch's order."""
    if order is None:
        return x
    out = torch.empty_like(x)
    out[order.to(x.device)] = x
    return out


def scored_in_pieces(
    score: Callable[[Rollouts], Sequence[Tensor | None]],
    rollouts: Rollouts,
    config: TrainConfig,
    dp: SingleProcess | DataParallel,
) -> list[Tensor | None]:
    """``score``'s outputs over the whole batch, computed micro-batch by micro-batch
    (:func:`micro_batch_pairs`, each trimmed of the padding no row in it uses): each ``(b t)``
    in the batch's row order, zero-padded to ``t`` columns; an output ``score`` gives as None
    stays None. A data-parallel group's padding micro-batches run (FSDP's collectives must
    match) and are thrown away. The batch needs a row."""
    t = rollouts.response_ids.shape[1]
    pairs, order = micro_batch_pairs(rollouts, config, dp)
    parts = []
    for micro, real in pairs:
        scores = score(micro.trim())
        if real:  # padding micro-batches only keep FSDP's collectives in step
            parts.append(scores)
    return [
        None
        if out[0] is None
        else in_batch_order(torch.cat([pad_columns(x, t) for x in out]), order)
        for out in zip(*parts, strict=True)
    ]
