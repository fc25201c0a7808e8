"""A run's metrics as JSON lines.

``RunLog(path).log(step, metrics)`` appends one line per step and flushes it at once, so a crash
loses nothing already logged; ``read_metrics(path)`` reads them back. Drawing them is the
notebook package's job, ``rb.plot(path, "curves.png")``: the notebook code imports this module,
never the other way round.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


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


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value
