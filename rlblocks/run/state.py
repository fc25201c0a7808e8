"""What the run floor keeps about a run besides its blocks: where the data stands, and the
run's configuration as plain JSON.

`Drawn` counts the batches a run has drawn, so that a resumed run draws the next one: from the
source's own ``state_dict`` when it has one (`rlblocks.data.PromptBatches`: epoch and position,
so epoch boundaries and reshuffles are exact), else by drawing and dropping as many batches
from a fresh iterator as the saved run had drawn (exact for a list, or any source that yields
the same batches in the same order each time).

`run_config` turns a recipe's arguments into JSON (numbers, strings, dataclasses as dicts,
functions by qualified name), for the checkpoint (a resumed run names what changed,
`rlblocks.run.resume`) and the trackers (logged once).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from rlblocks.interfaces import Stateful


class Drawn:
    """An iterator over ``source`` that knows how many items it has handed out (module
    docstring). ``state_dict``/``load_state_dict`` make it a `Stateful` checkpoint block; load
    before drawing the first item."""

    def __init__(self, source: Iterable[Any]) -> None:
        self.source = source
        self.drawn = 0
        self._iterator: Iterator[Any] | None = None

    def __iter__(self) -> Drawn:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self.source)
        item = next(self._iterator)  # StopIteration passes through: the data ran out
        self.drawn += 1
        return item

    def state_dict(self) -> dict[str, Any]:
        """The data position: how many batches have been drawn."""
        source = self.source.state_dict() if isinstance(self.source, Stateful) else None
        return {"drawn": self.drawn, "source": source}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the data position saved by ``state_dict``."""
        if self._iterator is not None:
            raise RuntimeError(
                "Drawn.load_state_dict: batches were already drawn; load the state before the "
                "first batch is drawn"
            )
        drawn = int(state["drawn"])
        if state["source"] is not None and isinstance(self.source, Stateful):
            self.source.load_state_dict(state["source"])
            self._iterator = iter(self.source)
        else:  # replay: draw what the saved run drew, and drop it
            self._iterator = iter(self.source)
            skipped = sum(1 for _ in itertools.islice(self._iterator, drawn))
            if skipped < drawn:
                raise ValueError(
                    f"Drawn.load_state_dict: the saved run had drawn {drawn} batches, this "
                    f"source holds only {skipped}; resume with the same batches (or a longer "
                    f"source)"
                )
        self.drawn = drawn


#: Arguments of a recipe that say how the run is driven, not what it computes: left out (the
#: loop adds what of ``run`` changes the numbers, `RunOptions.describe`).
LOOP_ARGUMENTS = frozenset({"run"})

#: Arguments of a recipe that are trainers: their ``config`` is part of the run's.
TRAINERS = ("policy", "critic")


def run_config(recipe: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """``{"recipe": recipe, **arguments}`` as JSON values (`describe`), without the
    `LOOP_ARGUMENTS`; the trainers (`TRAINERS`) are described by their type and, when they
    have one, their ``config`` (`TrainConfig`), as ``policy_config`` and ``critic_config``.
    A recipe passes its ``locals()`` before anything else."""
    config: dict[str, Any] = {"recipe": recipe}
    for name, value in arguments.items():
        if name in LOOP_ARGUMENTS:
            continue
        config[name] = describe(value)
        trainer_config = getattr(value, "config", None) if name in TRAINERS else None
        if trainer_config is not None:  # its TrainConfig: lr, schedule, ... (one read: a
            config[f"{name}_config"] = describe(trainer_config)  # handle's is a round trip)
    return config


def describe(value: Any) -> Any:
    """A JSON value that says what ``value`` is, the same in every process: numbers, strings,
    None and booleans as they are; sequences and mappings element-wise; dataclasses as dicts;
    ``functools.partial`` as ``name(keywords)``; functions and classes by qualified name; other
    objects by their type's name (their ``repr`` may hold a memory address)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): describe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [describe(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, **fields}
    if isinstance(value, functools.partial):
        keywords = ", ".join(f"{k}={describe(v)!r}" for k, v in value.keywords.items())
        return f"{describe(value.func)}({keywords})"
    name = getattr(value, "__qualname__", None)
    if callable(value) and isinstance(name, str) and "<" not in name:
        return f"{getattr(value, '__module__', '')}.{name}"
    return type(value).__name__


__all__ = ["LOOP_ARGUMENTS", "TRAINERS", "Drawn", "describe", "run_config"]
