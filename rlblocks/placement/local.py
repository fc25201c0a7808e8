"""``Local()``: every role runs in the current process (a notebook kernel, a script).

Nothing is wrapped, so ``breakpoint()`` inside a reward function or a loss just works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

ROLES = ("actor", "rollout", "ref", "critic", "reward", "teacher")


class Local:
    """Builds each block in this process and returns the block itself."""

    def build(self, role: str, factory: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Call ``factory(*args, **kwargs)`` in this process and return the block itself (``role``
        is only a name here)."""
        if role not in ROLES:
            raise ValueError(f"Local.build: unknown role {role!r}; use one of {', '.join(ROLES)}")
        return factory(*args, **kwargs)

    def shutdown(self) -> None:
        """Nothing to stop: the blocks live and die with this process (here for symmetry with
        ``Ray``, so that a script ending in ``placement.shutdown()`` runs with either)."""

    def __enter__(self) -> Local:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return "Local()"
