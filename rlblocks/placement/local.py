"""``Local()``: every role runs in the current process (a notebook kernel, a script).

Nothing is wrapped, so ``breakpoint()`` inside a reward function or a loss just works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

ROLES = ("actor", "rollout", "ref", "critic", "reward")


class Local:
    """Builds each block in this process and returns the block itself."""

    def build(self, role: str, factory: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        return factory(*args, **kwargs)

    def __repr__(self) -> str:
        return "Local()"
