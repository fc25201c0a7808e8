"""A run's metrics as JSON lines.

``RunLog(path).log(step, metrics)`` appends one line per step and flushes it at once, so a crash
loses nothing already logged; ``read_metrics(path)`` reads them back. Drawing them is the
notebook package's job, ``rb.plot(path, "curves.png")``: the notebook code imports this module,
never the other way round. `rlblocks.tracking.Tracker` writes its ``metrics.jsonl`` with a
``RunLog``, and cuts it back with :func:`truncate` when a run resumes from a checkpoint.

Values are written as plain JSON (:func:`plain`): a one-element tensor or NumPy value becomes a
Python number, a larger one a (nested) list. NaN and ±inf are written as ``NaN`` /
``Infinity``, which is not strict JSON but what Python's ``json`` (and so :func:`read_metrics`)
reads back: a step the NaN guard skipped keeps its NaN.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class RunLog:
    """Appends ``{"step": step, **metrics}`` as one JSON line per call; keeps them in ``records``.

    ``records``: the records this log starts with (those a resumed run kept, see
    :func:`truncate`); new ones are appended to it.
    """

    def __init__(
        self, path: str | Path | None = None, *, records: list[dict[str, Any]] | None = None
    ) -> None:
        self.path = None if path is None else Path(path)
        self.records: list[dict[str, Any]] = list(records or [])
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one step's metrics as a JSON line (numbers made plain floats) and return the
        record written."""
        record = {"step": step, **{k: plain(v) for k, v in metrics.items()}}
        self.records.append(record)
        if self.path is not None:
            append_line(self.path, record)
        return record


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, in order.

    A last line cut short (no newline, not valid JSON: the run was killed while writing it, or
    is writing it now) is skipped with a warning naming the file and the line. Any other line
    that is not a JSON object raises ``ValueError`` naming the file and the line.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")  # the last item is "" when the file ends with a newline
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # no newline after it: half-written
                warnings.warn(
                    f"{path}, line {number}: skipped a half-written last line ({error.msg} at "
                    f"column {error.colno}; {len(line)} characters, no newline)",
                    stacklevel=2,
                )
                break
            raise ValueError(
                f"read_metrics: {path}, line {number}: not a metrics record ({error.msg} at "
                f"column {error.colno}): {line!r:.80}; pass a metrics.jsonl a run wrote"
            ) from None
        if not isinstance(record, dict):
            raise ValueError(  # noqa: TRY004 -- a bad line in a file is always a ValueError
                f"read_metrics: {path}, line {number}: expected a JSON object, got "
                f"{line!r:.80}; pass a metrics.jsonl a run wrote"
            )
        records.append(record)
    return records


def metrics_frame(source: str | Path | Sequence[Mapping[str, Any]]) -> Any:
    """A run's metrics as a ``pandas.DataFrame``, one row per step, one column per metric.

    ``source``: a metrics JSONL file (read with :func:`read_metrics`), or the records
    themselves (``RunLog.records``, ``Tracker.records``, the history a recipe returns). A
    metric missing at some step is NaN there; non-scalar values stay as they were logged.
    """
    import pandas as pd

    records = read_metrics(source) if isinstance(source, str | Path) else list(source)
    return pd.DataFrame.from_records([dict(r) for r in records])


def append_line(path: Path, record: Mapping[str, Any]) -> None:
    """Append ``record`` as one JSON line, flushed when the file closes."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def truncate(path: str | Path, step: int) -> list[dict[str, Any]]:
    """Drop the records with ``record["step"] >= step`` from a JSONL file; return those kept.

    For a run resumed from a checkpoint taken after ``step`` steps: the steps logged after the
    checkpoint are redone, so their old lines must go. The file is rewritten with
    :func:`write_atomic`. A missing file stays missing (nothing to keep).
    """
    path = Path(path)
    if not path.exists():
        return []
    kept = [r for r in read_metrics(path) if r["step"] < step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def write_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` by ``text``: a temporary file in the same folder, fsync, ``os.replace``,
    so that a crash leaves the old file or the new one, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plain(value: Any) -> Any:
    """``value`` as JSON can hold it: a one-element tensor or NumPy value becomes a Python
    number, a larger one a (nested) list; anything else is returned as it is."""
    if hasattr(value, "numel"):  # torch.Tensor
        return value.item() if value.numel() == 1 else value.tolist()
    if hasattr(value, "tolist") and hasattr(value, "size"):  # NumPy array or scalar
        return value.item() if value.size == 1 else value.tolist()
    return value
