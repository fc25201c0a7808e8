"""MLflow, local: a SQLite store ``<folder>/mlflow/mlflow.db`` and its artifacts beside it.

MLflow 3 puts its plain-file store (``file:./mlruns``) in maintenance mode: opening one raises
unless ``MLFLOW_ALLOW_FILE_STORE=true`` is set, and its default local store is now SQLite. So
this backend uses ``sqlite:///<folder>/mlflow/mlflow.db`` (the tables MLflow creates on first
use) with the experiment's artifacts in ``<folder>/mlflow/artifacts``; it needs
``sqlalchemy`` and ``alembic`` beside ``mlflow-skinny`` (the ``tracking`` extra has them). It
talks to the store through its own ``MlflowClient``, never ``mlflow.set_tracking_uri``, so it
leaves MLflow's process-wide state alone.

- metrics: ``log_batch`` of one ``Metric(name, value, timestamp, step)`` per name, names
  unchanged (MLflow stores +inf / -inf as ±1.8e308, its own clamp; NaN stays NaN);
- the configuration: once, as run parameters (nested keys joined with dots, values as text,
  MLflow's limit of 6000 characters a value) and whole as the artifact ``config.json``;
- samples: ``log_table`` to the artifact ``samples/step_<step>.json`` (columns prompt,
  completion, reward), which the MLflow UI shows as a table.

The experiment is named after the tracker's ``project``, the run after its ``run_name``.
**Resume** (``resume_step=k``): MLflow cannot delete logged metric values, so reopening the run
would keep two values for each step from k on; a new run ``<run_name>-resume<k>`` is started
in the same experiment, with the tag ``resume_step = k``.

Browse with ``mlflow ui --backend-store-uri sqlite:///<folder>/mlflow/mlflow.db`` (the UI comes
with the full ``mlflow`` package).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlblocks.tracking.backend import BACKENDS, require
from rlblocks.tracking.samples import Sample

#: MLflow's limit on a parameter's value, in characters.
PARAM_CHARS = 6000


class MLflow:
    """An MLflow run in a SQLite store inside ``folder / "mlflow"``."""

    name = "mlflow"

    def __init__(self, folder: str | Path, *, project: str, run_name: str, **_: Any) -> None:
        require("mlflow", "mlflow-skinny")
        require("sqlalchemy")  # the SQLite store
        require("alembic")  # creates the store's tables
        self.root = Path(folder) / "mlflow"
        self.uri = f"sqlite:///{(self.root / 'mlflow.db').resolve()}"
        self.project = project
        self.run_name = run_name
        self.client: Any = None
        self.run_id: str | None = None

    def start(self, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        """Open the MLflow run and record the configuration (a resumed run continues from
        ``resume_step``)."""
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.root.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(self.project)
        if experiment is None:
            artifacts = (self.root / "artifacts").resolve().as_uri()
            experiment_id = self.client.create_experiment(self.project, artifacts)
        else:
            experiment_id = experiment.experiment_id
        name, tags = self.run_name, {}
        if resume_step is not None:
            name, tags = f"{name}-resume{resume_step}", {"resume_step": str(resume_step)}
        self.run_id = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in flatten(config).items()]
        self.client.log_batch(self.run_id, params=params)
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log one step's scalar metrics."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_samples(self, step: int, rows: Sequence[Sample]) -> None:
        """Log a table of sampled completions at ``step``."""
        columns = {field: [getattr(r, field) for r in rows] for field in Sample._fields}
        self.client.log_table(self.run_id, data=columns, artifact_file=samples_file(step))

    def close(self) -> None:
        """Flush and finish the run; a second call does nothing."""
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None


def samples_file(step: int) -> str:
    """The artifact that holds the samples table of ``step``."""
    return f"samples/step_{step:06d}.json"


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: MLflow parameters are flat."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= flatten(value, f"{name}.")
        else:
            out[name] = value
    return out


BACKENDS.register("mlflow", (MLflow, "mlflow"))
