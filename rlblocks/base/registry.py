"""Names for blocks, for config files and command lines: one `Registry` per kind of block.

A block carries its own name: the module that defines a loss, an estimator, an engine or a
recipe registers it there, beside its definition, so adding one touches no list elsewhere::

    LOSSES = Registry("loss", key="loss.name")      # in the kind's package (losses/names.py)

    @LOSSES.register("gspo")                        # in losses/gspo.py, on the function
    def gspo(...): ...

    ESTIMATORS.register("dr_grpo", partial(grpo, scale_by_std=False))   # a variant: call form

The command line, the YAML config and the demo only read registries. Code keeps passing the
functions themselves (docs/contributing.md): a name is for the edge of a program. A registry is
a ``dict`` (``name in``, ``[name]``, ``sorted``, ``monkeypatch.setitem`` work as on the plain
tables it replaced) that refuses a name registered twice, naming both places, and whose failed
lookup names the key that asked and the known names (the same line registering again, a
notebook cell run twice, replaces its entry). Registries are process-global: `restored` undoes
what a test registered. This module imports nothing of rlblocks, so any block may import it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, overload

T = TypeVar("T")
D = TypeVar("D")


class Registry(dict[str, T]):
    """Name -> block of one kind (``kind``: "loss"), named in config files by ``key``
    ("loss.name", the flag or YAML key that reads it)."""

    def __init__(self, kind: str, *, key: str) -> None:
        super().__init__()
        self.kind = kind
        self.key = key
        self.where: dict[str, str] = {}
        """Name -> where it was registered (``module:line``), for the duplicate message."""

    @overload
    def register(self, name: str | None = None) -> Callable[[D], D]: ...
    @overload
    def register(self, name: str, block: T) -> T: ...
    def register(self, name: str | None = None, block: Any = None) -> Any:
        """``@register(name)`` on a definition (None: its ``__name__``), or
        ``register(name, block)`` for a value (a ``partial``, an instance); returns the block."""
        caller = sys._getframe(1)  # the line that registers: named when a name comes twice
        here = f"{caller.f_globals.get('__name__', '?')}:{caller.f_lineno}"

        def add(block: Any) -> Any:
            chosen = name if name is not None else block.__name__
            if chosen in self and self.where.get(chosen) != here:  # the same line again (a
                # module reloaded, a notebook cell run twice) replaces its own entry
                raise ValueError(
                    f"Registry.register: the {self.kind} {chosen!r} ({self.key}) is registered "
                    f"twice, at {self.where.get(chosen, 'an unknown place')} and at {here}; "
                    "rename one"
                )
            self[chosen] = block
            self.where[chosen] = here
            return block

        return add if block is None else add(block)

    def unregister(self, name: str) -> T:
        """Remove ``name`` (a test's own entry) and return its block."""
        self.where.pop(name, None)
        return self.pop(name)

    def unknown(self, name: str, key: str | None = None) -> str:
        """The message for a name not registered, naming ``key`` (default: the registry's)."""
        return f"{key or self.key}: unknown {self.kind} {name!r}; one of {sorted(self)}"

    def __missing__(self, name: str) -> T:
        raise KeyError(self.unknown(name))


@contextmanager
def restored(*registries: Registry[Any]) -> Iterator[None]:
    """Put ``registries`` back as they were on exit: a test's registrations undone."""
    saved = [(r, dict(r), dict(r.where)) for r in registries]
    try:
        yield
    finally:
        for registry, entries, where in saved:
            registry.clear()
            registry.update(entries)
            registry.where.clear()
            registry.where.update(where)
