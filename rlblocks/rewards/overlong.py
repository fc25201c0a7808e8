"""DAPO soft overlong punishment: a length penalty that ramps up inside a buffer before the cap.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476, §3.4, eq. 13. Truncated samples would otherwise get the same reward as wrong
ones for a reason the model cannot see; the ramp tells it "too long" smoothly. Add it to the
task reward with `combine` (DAPO uses L_max = 20480, L_cache = 4096).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlblocks.interfaces import RewardFn, RewardOutput

if TYPE_CHECKING:
    from rlblocks.rollouts import Rollouts


def overlong_penalty(
    lengths: Tensor, *, max_length: int, cache_length: int, factor: float = 1.0
) -> Tensor:
    """DAPO eq. 13, scaled by ``factor``: the length reward of each response.

        R_length(y) = 0                                 |y| ≤ L_max − L_cache
                      ((L_max − L_cache) − |y|) / L_cache   L_max − L_cache < |y| ≤ L_max
                      −1                                |y| > L_max

    i.e. ``factor · clamp(((L_max − L_cache) − |y|) / L_cache, −1, 0)``: the ramp is exactly −1 at
    ``|y| = L_max`` and is held there beyond. ``factor`` is verl's ``overlong_buffer.
    penalty_factor`` (1.0 in the paper).

    ``lengths``: (b) int, the number of response tokens |y|. Returns (b) float32 (nothing to
    detach: lengths carry no gradient). ``max_length`` is L_max, ``cache_length`` is L_cache,
    0 < L_cache ≤ L_max.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"overlong_penalty: need 0 < cache_length <= max_length, "
            f"got cache_length={cache_length}, max_length={max_length}; pass values in that order"
        )
    if lengths.dim() != 1:
        raise ValueError(
            f"overlong_penalty: lengths must be (b), got shape {tuple(lengths.shape)}; pass one "
            "response length per row"
        )
    expected = max_length - cache_length  # L_max − L_cache: longest response with no penalty
    # Integer difference first (exact), one float division: the ramp values are exact ratios.
    over = (expected - lengths.long()).double() / cache_length
    return (factor * over.clamp(min=-1.0, max=0.0)).float()


def overlong(*, max_length: int, cache_length: int, factor: float = 1.0) -> RewardFn:
    """`RewardFn` for DAPO eq. 13 (`overlong_penalty`) on ``rollouts.response_lengths``.

    rᵢ = factor · R_length(yᵢ), (b) float32, no gradient. |yᵢ| is ``response_lengths``: every
    real response token, tool-observation tokens of a multi-turn rollout included (they fill the
    context budget too). Metrics: ``reward/mean``, ``reward/penalized_fraction`` (rows longer than
    L_max − L_cache: inside the buffer or beyond) and ``reward/max_length_fraction`` (rows with |yᵢ| ≥ L_max,
    usually truncated by the engine).
    """
    # Validate now, at construction, rather than at the first batch.
    overlong_penalty(torch.zeros(0), max_length=max_length, cache_length=cache_length)

    def overlong_reward(rollouts: Rollouts, /) -> RewardOutput:
        lengths = rollouts.response_lengths.cpu()
        rewards = overlong_penalty(
            lengths, max_length=max_length, cache_length=cache_length, factor=factor
        )
        n = max(len(lengths), 1)
        metrics = {
            "reward/mean": float(rewards.sum()) / n,
            "reward/penalized_fraction": float((lengths > max_length - cache_length).sum()) / n,
            "reward/max_length_fraction": float((lengths >= max_length).sum()) / n,
        }
        return RewardOutput(rewards, metrics)

    overlong_reward.__name__ = overlong_reward.__qualname__ = "overlong"
    return overlong_reward
