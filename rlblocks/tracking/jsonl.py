"""The files a tracker always writes into its folder: the run's own record, in plain JSON.

- ``metrics.jsonl``: ``{"step": step, **metrics}`` per step, flushed at once
  (`rlblocks.tracking.runlog.RunLog`; every value as logged, non-scalars included, see
  `rlblocks.tracking.runlog.plain`). ``rb.plot`` and the notebook dashboard read it.
- ``samples.jsonl``: one line per sampled completion, ``{"step", "prompt", "completion",
  "reward"}``, at the steps that have a samples table.
- ``config.json``: the run's configuration, written once when the run starts.

A folder holds one run: starting a run where ``metrics.jsonl`` or ``samples.jsonl`` is not empty
is an error, unless the run resumes (``resume_step=k``); then both files lose their lines with
step >= k (rewritten atomically, `rlblocks.tracking.runlog.truncate`), so no step is there twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlblocks.tracking.runlog import append_line, truncate, write_atomic
from rlblocks.tracking.samples import Sample

METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
CONFIG = "config.json"


class JsonlFiles:
    """``metrics.jsonl``'s checks, ``samples.jsonl`` and ``config.json`` in ``folder``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.metrics = self.folder / METRICS
        self.samples = self.folder / SAMPLES
        self.config = self.folder / CONFIG

    def start(self, config: Mapping[str, Any], resume_step: int | None) -> list[dict[str, Any]]:
        """Check or cut back the files, write ``config.json``; return the metrics records kept."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            for path in (self.metrics, self.samples):
                if path.exists() and path.stat().st_size > 0:
                    raise FileExistsError(
                        f"Tracker.start: {path} already holds a run's records; use another "
                        "folder, or pass resume_step=k to resume that run after its first k steps"
                    )
            kept = []
        else:
            kept = truncate(self.metrics, resume_step)
            truncate(self.samples, resume_step)
        write_atomic(self.config, json.dumps(dict(config), indent=2, default=str) + "\n")
        return kept

    def log_samples(self, step: int, rows: Sequence[Sample]) -> None:
        """Append the samples of ``step`` to ``samples.jsonl``, one JSON line each."""
        for row in rows:
            append_line(self.samples, {"step": step, **row._asdict()})
