"""Checks a run makes before its first step, so that a run that would train on nothing is
refused by name instead of ending "successfully" having done nothing.

`check_steps`: ``steps`` must be a positive count. ``range(steps)`` of 0 or ``-3`` is empty, so
such a run used to return an empty history (and the CLI exit with status 0) without a word.
"""

from __future__ import annotations

import operator


def check_steps(name: str, steps: int) -> None:
    """Raise ``ValueError`` naming the run (``name``: GRPO, PPO, ...) unless ``steps`` is an
    integer (anything ``range`` takes: a NumPy integer too, not a bool) of at least 1."""
    try:
        count = None if isinstance(steps, bool) else operator.index(steps)
    except TypeError:
        count = None
    if count is None:
        raise ValueError(
            f"{name}: steps={steps!r} is not a count of steps; pass the number of steps to run, "
            "an int >= 1"
        )
    if count < 1:
        raise ValueError(
            f"{name}: steps={steps!r} runs no step, so nothing would be trained; pass the number "
            "of steps to run, an int >= 1"
        )


__all__ = ["check_steps"]
