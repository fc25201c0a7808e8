"""How a placement's worker group splits a call of a block's method over its workers.

A block declares it on the method (``@dispatch("rows")``); a placement reads it back with
:func:`dispatch_of`. The block knows no placement and the placement no block class: this
declaration is all they share. Re-exported by ``rlblocks.interfaces``, with the contracts.

This module imports nothing of rlblocks.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

__all__ = ["Dispatch", "dispatch", "dispatch_of"]

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(str, Enum):
    """How a placement's worker group hands a method call to its workers.

    A block declares it on a method with :func:`dispatch`; an undeclared method is ``ROWS``
    when one of its arguments is a ``Rollouts`` and ``ALL`` otherwise. In one process
    (``Local()``) nothing is split and the declaration changes nothing.
    """

    ALL = "all"
    """Every worker gets the same arguments; the first worker's answer comes back (a block that
    splits the work itself, like ``PolicyTrainer.step``, answers for the whole group)."""
    ROWS = "rows"
    """The rows of the ``Rollouts`` argument (and of every ``(b …)`` tensor argument) are split
    over the workers, balanced by tokens, each worker getting at least one row; tensor answers
    are put back in row order, a dict of numbers is averaged weighted by rows."""
    PROMPTS = "prompts"
    """The prompts (first argument) and their ``metadata`` are cut into contiguous pieces, one
    per worker; the ``Rollouts`` answers are concatenated in prompt order, group ids renumbered."""


def dispatch(mode: Dispatch | str) -> Callable[[F], F]:
    """Declare how a worker group splits calls of the decorated method (:class:`Dispatch`)."""
    mode = Dispatch(mode)

    def declare(method: F) -> F:
        method.__rlblocks_dispatch__ = mode  # type: ignore[attr-defined]  # read by dispatch_of
        return method

    return declare


def dispatch_of(method: Callable[..., Any]) -> Dispatch | None:
    """The :class:`Dispatch` a method declared with :func:`dispatch`, or None."""
    return getattr(method, "__rlblocks_dispatch__", None)
