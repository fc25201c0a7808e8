"""Keywords a function no longer takes, and attributes a module no longer has, each failing with
a message that names its new place.

    @moved_keywords(samples_per_prompt="group_size=")
    def ppo(..., group_size: int = 1): ...

    ppo(..., samples_per_prompt=4)
    # TypeError: ppo: samples_per_prompt= is no longer a keyword; use group_size=

    __getattr__ = gone_attributes(__name__)  # rlblocks.recipes; its old names: GONE
    rb.recipes.OneStepOff
    # AttributeError: rlblocks.recipes.OneStepOff: moved; use rb.run.RunOptions(staleness=1, ...)

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

        return checked  # type: ignore[return-value]  # it takes fn's arguments (a wrapper)

    return decorate


#: Every attribute a module of rlblocks no longer has, in one table: module -> old name ->
#: (what happened to it, what to use now).
GONE: dict[str, dict[str, tuple[str, str]]] = {
    "rlblocks.recipes": {
        # moved to the run floor
        "OneStepOff": (
            "moved",
            "rb.run.RunOptions(staleness=1, old_logprobs=...), passed as run=",
        ),
    },
}


def gone_attributes(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module`` (its ``__name__``): each old name that `GONE`
    lists for it raises an ``AttributeError`` saying what happened to it ("renamed", "moved")
    and naming its replacement; any other name, Python's usual ``AttributeError``."""
    where = GONE.get(module, {})

    def __getattr__(name: str) -> Any:
        if name in where:
            how, new = where[name]
            raise AttributeError(f"{module}.{name}: {how}; use {new}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["GONE", "gone_attributes", "moved_keywords"]
