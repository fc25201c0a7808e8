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
- **A reward that fails on every row, call after call, stops the run.** A guarded reward
  (`per_sample`, `from_trl`, `from_verl`, the rule rewards) gives a row that raised or timed
  out the fallback score and goes on, which is right for one odd completion; when *every* row
  of a call fell back (``…/failures`` equal to the rows, for the reward or for one component
  of a `combine`, or every score non-finite), every group's rewards are equal, every advantage
  is 0, and the step trains on nothing. After ``max_failed_calls`` such calls in a row
  (`MAX_FAILED_CALLS`, 5, by default) the call raises `RewardFailedError`, naming the reward,
  the metric and the last failure as the reward logged it (`rlblocks.rewards.outcome`); the
  run stops there, its earlier checkpoints kept. Any call in which one row scored ends the
  streak. Every recipe makes one call a step, except DAPO, whose dynamic sampling scores each
  generation round: there it counts rounds.

  Why 5, and why here: a scorer that is down for a moment (a remote sandbox restarting, a
  spike of timeouts) costs a step or two and the run goes on; a reward broken from the start
  (a column renamed, a package missing in the workers) stops after 5 steps instead of training
  on nothing to the end. It lives in `checked`, the one place every recipe passes each reward
  call through, which sees the rows and the metrics of each call; a run chooses another K by
  passing its own ``rb.rewards.checked(reward, max_failed_calls=K)`` (None: never stop) as the
  recipe's reward, which the recipe then uses as it is.
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
from rlblocks.rewards.outcome import failure_notes

if TYPE_CHECKING:
    from rlblocks.rollouts import Rollouts

logger = logging.getLogger(__name__)

CONTRACT = (
    "a RewardFn returns RewardOutput(rewards, metrics): rewards a (b) float tensor with one "
    "score per row of the Rollouts (b = len(rollouts)), metrics a dict of scalars such as "
    "{'reward/mean': 0.5}; rb.rewards.per_sample turns fn(completion, **row) -> float into one"
)


#: Reward calls in a row that may fall back on every row before `checked` stops the run.
MAX_FAILED_CALLS = 5


class RewardFailedError(RuntimeError):
    """Raised by a `checked` reward after ``max_failed_calls`` calls in a row in which every
    row fell back to the fallback score (module docstring)."""


def checked(
    reward_fn: RewardFn,
    *,
    fallback: float = 0.0,
    max_failed_calls: int | None = MAX_FAILED_CALLS,
) -> RewardFn:
    """``reward_fn`` with its output checked, its non-finite scores replaced by ``fallback``,
    and `RewardFailedError` raised after ``max_failed_calls`` calls in a row that fell back on
    every row (None: never; module docstring). A reward already checked is returned as it is."""
    if isinstance(reward_fn, Checked):
        return reward_fn
    if max_failed_calls is not None and max_failed_calls < 1:
        raise ValueError(
            f"checked: max_failed_calls must be >= 1 or None, got {max_failed_calls}; pass the "
            "number of all-failed reward calls in a row that stops the run, or None for never"
        )
    return Checked(reward_fn, fallback, max_failed_calls)


class Checked:
    """The reward function `checked` returns."""

    def __init__(self, reward_fn: RewardFn, fallback: float, max_failed_calls: int | None) -> None:
        self.reward_fn, self.fallback, self.name = reward_fn, float(fallback), _name(reward_fn)
        self.max_failed_calls = max_failed_calls
        self.failed_calls = 0
        """Calls in a row, up to now, in which every row fell back."""

    def __repr__(self) -> str:
        return (
            f"checked({self.name}, fallback={self.fallback}, "
            f"max_failed_calls={self.max_failed_calls})"
        )

    def __call__(self, rollouts: Rollouts, /) -> RewardOutput:
        with failure_notes() as notes:
            out = self.reward_fn(rollouts)
        rewards, metrics = _unpack(out, self.name, len(rollouts))
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
            # in float64: finite float32 scores near 3.4e38 sum past float32's range
            metrics["reward/mean"] = float(rewards.double().mean()) if len(rewards) else math.nan
        self._count(len(rollouts), metrics, notes)
        return RewardOutput(rewards, metrics)

    def _count(self, rows: int, metrics: Mapping[str, Any], notes: list[str]) -> None:
        """Count a call that fell back on every row; raise `RewardFailedError` at the limit."""
        if not rows:
            return  # nothing scored: neither a failure nor a success
        failed = _all_failed(rows, metrics)
        self.failed_calls = self.failed_calls + 1 if failed else 0
        if failed is None or self.max_failed_calls is None:
            return
        if self.failed_calls >= self.max_failed_calls:
            reason = notes[-1] if notes else "the reward's own warnings say why"
            raise RewardFailedError(
                f"RewardFn: {self.name} fell back on every row in {self.failed_calls} reward "
                f"calls in a row (the last: {failed} = {metrics[failed]:g} of {rows} rows), so "
                f"every advantage was 0 and those steps trained on nothing; the last failure: "
                f"{reason}. Fix the reward (or the data it reads), or pass rb.rewards.checked("
                f"reward, max_failed_calls=None) as the recipe's reward to go on regardless"
            )


def _all_failed(rows: int, metrics: Mapping[str, Any]) -> str | None:
    """The metric saying that every one of ``rows`` fell back (``reward/nonfinite``, or a
    guard's ``…/failures``: the reward's own or a `combine` component's), else None."""
    for key, value in metrics.items():
        counts = key == "reward/nonfinite" or key.endswith("/failures")
        if counts and isinstance(value, numbers.Real) and value >= rows:  # type: ignore[operator]  # typeshed's numbers.Real has < and <= only
            return key
    return None


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


__all__ = ["CONTRACT", "MAX_FAILED_CALLS", "Checked", "RewardFailedError", "checked"]
