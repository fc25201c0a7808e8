"""Where the running loop stands: the steps done, the steps it will run, the epochs of its
data drawn so far.

The run (`rlblocks.run.Run`) sets it before each step and clears it when the run ends;
a block that must state progress in another library's terms reads it with :func:`current`
(`rlblocks.rewards.from_trl` builds the ``trainer_state`` TRL passes its reward functions
from it). It is one value for the process, not per thread: reward functions run in worker
threads of the loop's process, and two loops at once in one process are not supported by the
blocks they share anyway. Outside a loop (a reward called by hand), :func:`current` is None.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """``step``: steps finished before the current one (TRL's ``global_step`` when each step
    is one update); ``steps``: the run's total; ``epoch``: epochs of the prompt data drawn
    before the current step's batch, fractional (None when the data cannot say)."""

    step: int
    steps: int | None = None
    epoch: float | None = None


_current: Progress | None = None


def current() -> Progress | None:
    """The loop's `Progress` now, or None outside a run."""
    return _current


def set_current(progress: Progress | None) -> None:
    """Set (the loop, before each step) or clear (None, when the run ends) the progress."""
    global _current
    _current = progress


__all__ = ["Progress", "current", "set_current"]
