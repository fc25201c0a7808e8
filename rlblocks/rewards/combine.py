"""`combine`: a weighted sum of reward functions, with each component's metrics kept apart."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from rlblocks.interfaces import RewardFn, RewardOutput
from rlblocks.rewards.guard import _name_of

if TYPE_CHECKING:
    from rlblocks.rollouts import Rollouts

Components = (
    Mapping[RewardFn, float] | Sequence[tuple[RewardFn, float] | tuple[str, RewardFn, float]]
)


def combine(components: Components, /) -> RewardFn:
    """A `RewardFn` returning the weighted sum of its components' rewards.

        rᵢ = Σₖ wₖ · rₖ,ᵢ          rewards (b) float32, no gradient

    ``components``: ``{fn: weight}``, or a list of ``(fn, weight)`` / ``(name, fn, weight)``.
    A component is named by ``name`` or by ``fn.__name__`` (through `functools.partial`); two
    components with the same name are an error (give one a name). Metrics: every component
    metric ``"reward/x"`` is renamed ``"<name>/x"`` (other keys ``k`` become ``"<name>/k"``),
    ``"<name>/weight"`` records the weight, and ``"reward/mean"`` is the mean of the total.

    Example, DAPO's accuracy reward plus overlong shaping (Yu et al. 2025, arXiv 2503.14476,
    eq. 13 added to the rule-based reward): ``combine({math_answer: 1.0, overlong(...): 1.0})``.
    """
    items = _normalize(components)

    def combined(rollouts: Rollouts, /) -> RewardOutput:
        total = torch.zeros(rollouts.batch_size, dtype=torch.float32)
        metrics: dict[str, float] = {}
        for name, fn, weight in items:
            rewards, component_metrics = fn(rollouts)
            if rewards.shape != total.shape:
                raise ValueError(
                    f"combine: component {name!r} returned rewards of shape "
                    f"{tuple(rewards.shape)}, expected ({rollouts.batch_size},); return one "
                    "reward per row"
                )
            total = total + weight * rewards.detach().float().cpu()
            for k, v in component_metrics.items():
                metrics[f"{name}/{k.removeprefix('reward/')}"] = float(v)
            metrics[f"{name}/weight"] = float(weight)
        metrics["reward/mean"] = float(total.mean()) if len(total) else 0.0
        return RewardOutput(total, metrics)

    return combined


def _normalize(components: Components) -> list[tuple[str, RewardFn, float]]:
    """``(name, fn, weight)`` triples, checked: non-empty, finite weights, unique names."""
    pairs = components.items() if isinstance(components, Mapping) else components
    items = []
    for entry in pairs:
        if len(entry) == 3:
            name, fn, weight = entry
        elif len(entry) == 2:
            fn, weight = entry
            name = _name_of(fn)
        else:
            raise ValueError(
                f"combine: expected (fn, weight) or (name, fn, weight), got {entry!r}; pass "
                "entries of one of those shapes"
            )
        if not callable(fn) or not math.isfinite(weight):
            raise ValueError(
                f"combine: component {name!r} has fn {fn!r} and weight {weight}; pass a callable "
                "and a finite weight"
            )
        items.append((str(name), fn, float(weight)))
    if not items:
        raise ValueError("combine: no components; pass at least one")
    names = [name for name, _, _ in items]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"combine: components share the names {duplicates}; pass (name, fn, weight) entries"
        )
    return items
