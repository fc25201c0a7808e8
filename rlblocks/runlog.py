"""A run's metrics as JSON lines, and a PNG of their curves.

``RunLog(path).log(step, metrics)`` appends one line per step and flushes it at once, so a crash
loses nothing already logged; ``plot_metrics(path, "curves.png")`` draws the curves.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: The curves drawn by default, when present: (metric key, title).
DEFAULT_CURVES: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward"),
    ("accuracy", "accuracy"),
    ("response_length", "response length (tokens)"),
    ("kl", "KL to reference"),
    ("kl/token", "KL to reference (per token)"),  # the PPO recipe's name
    ("entropy", "entropy"),
    ("clip_frac", "clip fraction"),
    ("grad_norm", "gradient norm"),
)


class RunLog:
    """Appends ``{"step": step, **metrics}`` as one JSON line per call; keeps them in ``records``."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.records: list[dict[str, Any]] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.records.append(record)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, in order."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(
    records: str | Path | Sequence[Mapping[str, Any]],
    out: str | Path,
    *,
    curves: Iterable[tuple[str, str]] = DEFAULT_CURVES,
) -> Path:
    """Draw each available curve against ``step`` into one PNG; returns its path.

    The same figure as the notebook dashboard's (:func:`rlblocks.notebook.plot`).
    """
    from rlblocks.notebook.figure import plot

    return plot(records, out, curves=curves)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value
