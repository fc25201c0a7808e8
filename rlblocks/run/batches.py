"""`Batches`, the run source of a plain stream of batches (SFT), and what every source does
when a `rlblocks.run.Run` takes it: `attach_once` (one run per source) and `mark_closed`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlblocks.run.loop import OutOfData, Run
from rlblocks.run.state import Drawn


class Batches:
    """A plain stream of batches, one a step (SFT): a run's `Source` without an engine."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self.data = Drawn(batches)
        self._run: Run | None = None

    def attach(self, run: Run) -> None:
        """Driven by ``run`` from now on; a second run is refused."""
        self._run = attach_once(self, self._run, run)

    def describe(self) -> dict[str, Any]:
        """Nothing of a plain stream changes the numbers."""
        return {}

    def draw(self) -> Any:
        """The next batch; `OutOfData` when the data ran out (the loop ends the run)."""
        batch = next(self.data, None)
        if batch is None:
            raise OutOfData
        return batch

    def blocks(self) -> dict[str, Any]:
        """The data position, for the checkpoint."""
        return {"data": self.data}

    def begin(self, index: int, *, remaining: int) -> None:
        """Nothing to prepare."""

    def metrics(self) -> dict[str, float]:
        """No metrics of its own."""
        return {}

    def resync(self) -> None:
        """No engine to sync."""

    def close(self) -> None:
        """The run ended: the stream is not drawn by another run."""
        mark_closed(self)


def attach_once(source: Any, attached: Run | None, run: Run) -> Run:
    """``run``, once checked to be the first run ``source`` is attached to."""
    if getattr(source, "_closed", False) or attached is not None:
        by = f"run {attached.name!r}" if attached is not None else "a run"
        owner = type(source).__name__
        raise RuntimeError(
            f"{owner}: already driven by {by}; a source belongs to one run "
            "(its data position and batches sampled ahead are that run's): build a new one "
            "for the new run (it resumes from the run's checkpoint)"
        )
    return run


def mark_closed(source: Any) -> None:
    """``source`` was closed by its run: `attach_once` refuses it from now on."""
    source._closed = True


__all__ = ["Batches", "attach_once", "mark_closed"]
