"""What scoring one row gives `per_sample`: a finite float, or a `Failure` that scores the fallback.

Shared by the thread mode (`rlblocks.rewards.guard`) and the process mode
(`rlblocks.rewards.isolation`), so that both judge a returned value the same way.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class Failure:
    """A row that gets the fallback score: ``kind`` is "error" or "timeout"."""

    kind: str
    message: str
    error: BaseException | None = None


Outcome = float | Failure


def checked_score(value: object) -> Outcome:
    """``value`` as a float if it is a finite real number (bools count), else a `Failure`."""
    if not isinstance(value, numbers.Real):
        return Failure("error", f"returned {type(value).__name__}, expected a real number")
    value = float(value)
    if not math.isfinite(value):
        return Failure("error", f"returned {value}, expected a finite number")
    return value
