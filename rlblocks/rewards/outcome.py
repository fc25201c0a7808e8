"""What scoring one row gives `per_sample`: a finite float, or a `Failure` that scores the fallback.

Shared by the thread mode (`rlblocks.rewards.guard`) and the process mode
(`rlblocks.rewards.isolation`), so that both judge a returned value the same way.

`failure_notes` collects, for the caller that opens it (`rlblocks.rewards.checked`), the
sentence a guarded reward logs when rows fall back (`note_failure`): so that a run stopped
because every row keeps failing says why, in the same words. A context variable, not an
attribute of the reward: a `combine` of several guarded rewards reports through it too, and
each thread (a background sampler, a Ray worker) collects only its own calls.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
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


_NOTES: ContextVar[list[str] | None] = ContextVar("rlblocks_reward_failure_notes", default=None)


@contextmanager
def failure_notes() -> Iterator[list[str]]:
    """The sentences `note_failure` records in this context while it is open, oldest first."""
    notes: list[str] = []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


def note_failure(text: str) -> None:
    """Record why rows of a guarded reward fell back, for an open `failure_notes` (else
    nothing: the warning a guarded reward logs says it anyway)."""
    notes = _NOTES.get()
    if notes is not None:
        notes.append(text)
