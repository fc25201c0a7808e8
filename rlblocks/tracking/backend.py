"""The contract every tracking backend follows, and the lazy import of its library.

A backend is any object with these four methods (a ``Protocol``: no base class to inherit).
The tracker calls them with exactly the stream it writes to ``metrics.jsonl``: the same steps,
the same metric names, unchanged. The notebook ``Dashboard`` follows it too, so it can be one
of a tracker's ``report_to`` entries.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from rlblocks.base.registry import Registry
from rlblocks.tracking.samples import Sample

#: The backends ``report_to`` names, with the module each one needs (for ``"all"``): each
#: backend registers itself below its class (``BACKENDS.register("wandb", (Wandb, "wandb"))``).
BACKENDS: Registry[tuple[Callable[..., TrackingBackend], str]] = Registry(
    "tracking backend", key="tracking"
)

#: What to install for every backend at once.
EXTRA = 'pip install "rlblocks[tracking]"'


@runtime_checkable
class TrackingBackend(Protocol):
    """Where a tracker sends a run: a file format, an experiment tracker, a live view."""

    def start(self, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        """Open the run and log its configuration, once. ``resume_step=k``: the run resumes
        from a checkpoint taken after ``k`` steps, the next step logged is ``k``."""

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        """One step's scalar metrics, under the names the recipes gave them."""

    def log_samples(self, step: int, rows: Sequence[Sample]) -> None:
        """A table of sampled completions (prompt, completion, reward) at ``step``."""

    def close(self) -> None:
        """Flush and finish the run; a second call does nothing."""


def require(module: str, package: str | None = None) -> ModuleType:
    """Import ``module`` or raise an ImportError that says what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = package or module
        raise ImportError(
            f"Tracker: the {module!r} tracking backend needs {package}, which is not "
            f"installed; {EXTRA} (every backend) or pip install {package}"
        ) from error
