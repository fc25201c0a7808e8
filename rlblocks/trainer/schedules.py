"""Learning-rate schedules: the multiplier of ``TrainConfig.lr`` at each optimizer step.

A schedule is any ``Callable[[int], float]`` taking the number of optimizer steps already applied
(0 for the first update) and returning the factor applied to the base learning rate; the trainer
drives it with ``torch.optim.lr_scheduler.LambdaLR``. The three below are small frozen
dataclasses, so that they print readably and ``LambdaLR.state_dict`` can save them.

Warmup counts from one: step k < warmup uses (k + 1) / warmup, so the very first update already
moves the weights. (transformers' ``get_*_schedule_with_warmup`` use k / warmup, an update at
learning rate 0 on step 0; in RL a batch of rollouts is the expensive part, so we do not waste
one.) Steps skipped by the NaN guard do not advance the schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    """m(k) = 1 at every step."""

    def __call__(self, step: int) -> float:
        return 1.0


@dataclass(frozen=True)
class WarmupConstant:
    """m(k) = min(1, (k + 1) / warmup): linear warmup, then constant."""

    warmup: int

    def __call__(self, step: int) -> float:
        return _warmup(step, self.warmup)


@dataclass(frozen=True)
class Cosine:
    """Linear warmup, then cosine decay from 1 to ``min_ratio`` at step ``total`` (held after)."""

    warmup: int
    total: int
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return _warmup(step, self.warmup)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _warmup(step: int, warmup: int) -> float:
    return 1.0 if warmup <= 0 else min(1.0, (step + 1) / warmup)


def constant() -> Constant:
    """The constant schedule: m(k) = 1. Input: step k (int); output: a float multiplier."""
    return Constant()


def warmup_constant(*, warmup: int) -> WarmupConstant:
    """Linear warmup then constant: m(k) = min(1, (k + 1) / warmup).

    Gradual warmup of Goyal et al. 2017, "Accurate, Large Minibatch SGD" (arXiv 1706.02677,
    sec. 2.2). ``warmup`` is in optimizer steps; ``warmup <= 0`` means no warmup (m = 1).
    Input: step k (int, optimizer steps already applied); output: a float multiplier.
    """
    if warmup < 0:
        raise ValueError(f"warmup_constant: warmup must be >= 0, got {warmup}; pass a step count")
    return WarmupConstant(warmup)


def cosine(*, warmup: int, total: int, min_ratio: float = 0.0) -> Cosine:
    """Linear warmup, then half-cosine decay to ``min_ratio``::

        m(k) = (k + 1) / warmup                                  k < warmup
        m(k) = ρ + (1 − ρ) · ½ (1 + cos(π · min(1, (k − warmup) / (total − warmup))))   otherwise

    with ρ = ``min_ratio``. Cosine annealing of Loshchilov & Hutter 2016, "SGDR" (arXiv
    1608.03983, eq. 5, one cycle, η_min = ρ·lr), after the gradual warmup of Goyal et al. 2017
    (arXiv 1706.02677). ``total`` is the step at which m reaches ρ; later steps stay at ρ.
    Input: step k (int, optimizer steps already applied); output: a float multiplier.
    """
    if warmup < 0 or total < warmup:
        raise ValueError(
            f"cosine: need 0 <= warmup <= total, got warmup={warmup}, total={total}; pass a "
            "warmup no longer than the run"
        )
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(
            f"cosine: min_ratio must be in [0, 1], got {min_ratio}; pass a fraction of lr"
        )
    return Cosine(warmup, total, min_ratio)
