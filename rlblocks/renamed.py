"""Keywords a function no longer takes, each failing with a message that names its new place.

    @moved_keywords(group_size="group_size=")
    def ppo(..., group_size: int = 1): ...

    ppo(..., group_size=4)
    # TypeError: ppo: group_size= is no longer a keyword; use group_size=

A base helper (it imports nothing of rlblocks): every layer may use it, so that a user who
meets an old name learns the new one instead of Python's bare "unexpected keyword argument".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def moved_keywords(**where: str) -> Callable[[F], F]:
    """Decorate a function so that each keyword of ``where`` (old name -> what to use now)
    raises a ``TypeError`` naming its replacement. The signature, docstring and attributes
    (``rlblocks.interfaces.dispatch``'s declaration) are the function's own."""

    def decorate(fn: F) -> F:
        name = fn.__qualname__

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            for old in kwargs:
                if old in where:
                    raise TypeError(f"{name}: {old}= is no longer a keyword; use {where[old]}")
            return fn(*args, **kwargs)

        return checked  # type: ignore[return-value]

    return decorate


__all__ = ["moved_keywords"]
