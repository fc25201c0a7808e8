"""`Tracker`: one run's metrics, configuration and sample completions, sent to every backend.

    tracker = rb.tracking.Tracker("runs/grpo", report_to=("tensorboard", "wandb"))
    rb.recipes.grpo(..., run=rb.run.RunOptions(tracker=tracker))  # starts it, logs each step
    tracker.close()

``metrics.jsonl`` is always written when there is a folder (`rlblocks.tracking.jsonl`); the
backends get the same stream: each step's scalars under the recipes' names, unchanged, and a
table of sampled completions every ``samples_every`` steps.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlblocks.base.extras import is_installed
from rlblocks.checkpoint.lock import FolderLock
from rlblocks.tracking.backend import BACKENDS, TrackingBackend
from rlblocks.tracking.jsonl import METRICS, JsonlFiles
from rlblocks.tracking.runlog import RunLog
from rlblocks.tracking.samples import Sample, pick_samples

if TYPE_CHECKING:
    from typing_extensions import Self

    from rlblocks.rollouts import Rollouts

ReportTo = str | TrackingBackend | Sequence[str | TrackingBackend]

#: The lock file of a tracker's folder (`rlblocks.checkpoint.lock`), and what its message says.
LOCK = ".tracker.lock"
IN_USE = {
    "owner": "Tracker.start",
    "advice": "close the tracker that holds it (tracker.close(), or open trackers with "
    "`with Tracker(...)`), or give this one another folder",
}


class Tracker:
    """Logs a run to ``folder`` (``metrics.jsonl``, ``samples.jsonl``, ``config.json``) and to
    the backends of ``report_to``.

    ``report_to``, as in TRL: ``"none"``; ``"all"`` (every backend whose library is
    installed); a name or a sequence of names among :data:`BACKENDS`; backend objects (any
    object with the four methods of :class:`~rlblocks.tracking.backend.TrackingBackend`, e.g. a
    notebook ``Dashboard``), alone or mixed with names. A named backend whose library is missing
    raises ImportError here, saying what to install. ``folder=None``: records only in memory
    (``records``), allowed only with backends that write no files.

    ``project``: the W&B / trackio project, the MLflow experiment. ``run_name``: the run's name
    in every backend (default: the start time and a random suffix). Every ``samples_every``
    steps (``step % samples_every == 0``; 0 or None: never) that come with rollouts, a table of
    ``samples`` completions, one per prompt group first.
    """

    def __init__(
        self,
        folder: str | Path | None = None,
        *,
        report_to: ReportTo = "none",
        project: str = "rlblocks",
        run_name: str | None = None,
        samples_every: int | None = 10,
        samples: int = 4,
    ) -> None:
        self.folder = None if folder is None else Path(folder)
        self.project = project
        self.run_name = run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        self.samples_every = samples_every
        self.samples = samples
        self.backends = resolve(report_to, self.folder, project=project, run_name=self.run_name)
        self.files = None if self.folder is None else JsonlFiles(self.folder)
        self.lock = None if self.folder is None else FolderLock(self.folder, LOCK, **IN_USE)
        """Held from `start` to `close`: one tracker writes into a folder at a time."""
        self.log_file = RunLog()
        self.started = False
        self.closed = False

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every record logged, in order (after a resume, the kept ones first)."""
        return self.log_file.records

    def start(self, config: Mapping[str, Any] | None = None, *, resume_step: int | None = None):
        """Open the run: ``config`` (JSON-able) is logged once, to ``config.json`` and to every
        backend. ``resume_step=k``: the run resumes from a checkpoint taken after ``k`` steps;
        records with step >= k are dropped from the JSONL files and each backend does what it
        supports (docs/tracking.md). Without it, a folder whose ``metrics.jsonl`` is not empty is
        an error (FileExistsError naming the file): two runs' metrics never mix. From here to
        `close` the tracker holds its folder's lock: another tracker started on the folder
        meanwhile fails at once (`rlblocks.checkpoint.lock.FolderInUseError`)."""
        if self.started:
            raise RuntimeError(
                "Tracker.start: this Tracker has already started its run; start a Tracker once "
                "(create a new one for another run)"
            )
        config = dict(config or {})
        if self.lock is not None:
            self.lock.acquire()  # a second tracker on the folder fails here, before writing
        try:
            kept = [] if self.files is None else self.files.start(config, resume_step)
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise
        path = None if self.folder is None else self.folder / METRICS
        self.log_file = RunLog(path, records=kept)
        self.started = True
        for backend in self.backends:
            backend.start(config, resume_step)

    def log(
        self, step: int, metrics: Mapping[str, Any], rollouts: Rollouts | None = None
    ) -> dict[str, Any]:
        """Log one step; returns the record written to ``metrics.jsonl``.

        The record is ``{"step": step, **metrics}`` with tensors and NumPy values made plain
        (`rlblocks.tracking.runlog.plain`). The backends get its scalars: the numbers (booleans as 0/1),
        NaN and ±inf included, under the same names; strings, lists and None stay in the JSONL
        only. With ``rollouts`` at a samples step, a samples table goes to the JSONL and every
        backend. Starts the run with an empty config when :meth:`start` was not called.
        """
        if self.closed:
            raise RuntimeError(
                "Tracker.log: this Tracker is closed; create a new one for another run"
            )
        if not self.started:
            self.start()
        record = self.log_file.log(step, metrics)
        scalars = scalars_of(record)
        rows = self._rows(step, metrics, rollouts)
        if rows and self.files is not None:
            self.files.log_samples(step, rows)
        for backend in self.backends:
            if rows:  # first: a live view shows the samples with the step's metrics
                backend.log_samples(step, rows)
            backend.log_metrics(step, scalars)
        return record

    def __call__(
        self, step: int, metrics: Mapping[str, Any], rollouts: Rollouts | None = None
    ) -> None:
        """:meth:`log`, with the signature of ``RunOptions.on_step``."""
        self.log(step, metrics, rollouts)

    def close(self) -> None:
        """Finish every backend's run (flushing what they buffer); a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        try:
            for backend in self.backends:
                backend.close()
        finally:
            if self.lock is not None:
                self.lock.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rows(
        self, step: int, metrics: Mapping[str, Any], rollouts: Rollouts | None
    ) -> list[Sample]:
        if rollouts is None or not self.samples_every or step % self.samples_every:
            return []
        return pick_samples(rollouts, metrics, k=self.samples)


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a record, as floats, ``step`` left out (it is every backend's x axis)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float))
    }


def resolve(
    report_to: ReportTo, folder: Path | None, *, project: str, run_name: str
) -> list[TrackingBackend]:
    """The backends ``report_to`` asks for (see :class:`Tracker`), built for ``folder``."""
    if isinstance(report_to, str) or not isinstance(report_to, Sequence):
        report_to = [report_to]
    entries: list[str | TrackingBackend] = []
    for entry in report_to:
        if entry == "all":
            entries += [name for name, (_, module) in BACKENDS.items() if is_installed(module)]
        elif entry != "none":
            entries.append(entry)
    backends = []
    for entry in entries:
        if not isinstance(entry, str):
            if not isinstance(entry, TrackingBackend):
                raise TypeError(
                    f"Tracker: report_to entry {entry!r} is not a tracking backend; pass a "
                    "backend name or an object with start, log_metrics, ..."
                )
            backends.append(entry)
            continue
        if entry not in BACKENDS:
            raise ValueError(
                f"Tracker: unknown backend {entry!r}; report_to takes {sorted(BACKENDS)}"
            )
        if folder is None:
            raise ValueError(
                f"Tracker: the {entry!r} backend writes files, and the Tracker has no folder; "
                "give the Tracker a folder"
            )
        backends.append(BACKENDS[entry][0](folder, project=project, run_name=run_name))
    return backends
