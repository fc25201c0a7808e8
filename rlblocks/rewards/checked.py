"""`checked`: where rewards enter a training loop, the `RewardFn` contract is enforced.

Every recipe scores rows through ``checked(reward_fn)``, so that one bad reward never costs a
step silently:

- **The contract.** A reward function returns ``RewardOutput(rewards, metrics)``: ``rewards`` a
  (b) tensor (or a sequence of b numbers), one score per row of the `Rollouts`; ``metrics`` a
  dict of scalars. Anything else (a bare tensor, a list of floats, a dict, the wrong number of
  scores) raises a ``TypeError`` / ``ValueError`` that names the function, says what it
  returned and restates the contract.
- **Non-finite scores.** A NaN or ±inf score would make its whole group's advantage NaN, and
  the trainer's NaN guard would then skip the whole step, every step. Such a row gets the
  ``fallback`` score instead (0.0 by default, as `per_sample` gives a failed row). The step's
  metrics count them (``reward/nonfinite``, also 0.0 when there are none, so a curve shows it)
  and a warning names the reward function and the rows, at every step that has any (through
  ``logging``: Python's ``warnings`` would show it once per process).
- ``reward/mean`` is recomputed over the scores actually used when the function's own is
  missing or not finite.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlblocks.interfaces import RewardFn, RewardOutput

if TYPE_CHECKING:
    from rlblocks.rollouts import Rollouts

logger = logging.getLogger(__name__)

CONTRACT = (
    "a RewardFn returns RewardOutput(rewards, metrics): rewards a (b) float tensor with one "
    "score per row of the Rollouts (b = len(rollouts)), metrics a dict of scalars such as "
    "{'reward/mean': 0.5}; rb.rewards.per_sample turns fn(completion, **row) -> float into one"
)


def checked(reward_fn: RewardFn, *, fallback: float = 0.0) -> RewardFn:
    """``reward_fn`` with its output checked and its non-finite scores replaced by
    ``fallback`` (module docstring). A reward already checked is returned as it is."""
    return reward_fn if isinstance(reward_fn, Checked) else Checked(reward_fn, fallback)


class Checked:
    """The reward function `checked` returns."""

    def __init__(self, reward_fn: RewardFn, fallback: float) -> None:
        self.reward_fn, self.fallback, self.name = reward_fn, float(fallback), _name(reward_fn)

    def __repr__(self) -> str:
        return f"checked({self.name}, fallback={self.fallback})"

    def __call__(self, rollouts: Rollouts, /) -> RewardOutput:
        rewards, metrics = _unpack(self.reward_fn(rollouts), self.name, len(rollouts))
        bad = ~torch.isfinite(rewards)
        metrics["reward/nonfinite"] = float(bad.sum())
        if bad.any():
            rows = bad.nonzero().flatten().tolist()
            shown = ", ".join(map(str, rows[:10])) + (" ..." if len(rows) > 10 else "")
            logger.warning(
                "reward function %s returned %d non-finite score(s) (rows %s, e.g. %r): those "
                "rows get the fallback score %s",
                self.name, len(rows), shown, rewards[rows[0]].item(), self.fallback,
            )  # fmt: skip
            rewards = torch.where(bad, torch.full_like(rewards, self.fallback), rewards)
        mean = metrics.get("reward/mean")
        if not isinstance(mean, numbers.Real) or not math.isfinite(mean):
            metrics["reward/mean"] = float(rewards.mean()) if len(rewards) else float("nan")
        return RewardOutput(rewards, metrics)


def _unpack(out: Any, name: str, rows: int) -> tuple[Tensor, dict[str, Any]]:
    """``(rewards (b) float32, metrics dict)`` from what the reward function returned."""
    if isinstance(out, Tensor) or not isinstance(out, tuple) or len(out) != 2:
        what = f"a {type(out).__name__}" + (
            f" of shape {tuple(out.shape)}" if isinstance(out, Tensor) else ""
        )
        raise TypeError(f"RewardFn: {name} returned {what}; {CONTRACT}")
    rewards, metrics = out
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"RewardFn: {name} returned metrics of type {type(metrics).__name__}; {CONTRACT}"
        )
    if not isinstance(rewards, Tensor):
        if not isinstance(rewards, Sequence) or isinstance(rewards, str):
            raise TypeError(
                f"RewardFn: {name} returned rewards of type {type(rewards).__name__}; {CONTRACT}"
            )
        try:
            rewards = torch.tensor([float(r) for r in rewards])
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"RewardFn: {name} returned rewards that are not numbers ({err}); {CONTRACT}"
            )
    if rewards.shape != (rows,):
        raise ValueError(
            f"RewardFn: {name} returned rewards of shape {tuple(rewards.shape)} for "
            f"{rows} rows; {CONTRACT}"
        )
    if rewards.is_complex() or rewards.dtype == torch.bool:
        raise TypeError(f"RewardFn: {name} returned {rewards.dtype} rewards; {CONTRACT}")
    return rewards.detach().float().cpu(), dict(metrics)


def _name(fn: Any) -> str:
    inner = getattr(fn, "func", None)  # functools.partial
    name = getattr(fn, "__qualname__", None) or getattr(inner, "__qualname__", None)
    return name or type(fn).__name__


__all__ = ["CONTRACT", "Checked", "checked"]
