"""trackio, local: a SQLite database per project in trackio's directory, ``<folder>/trackio``.

trackio keeps every project in ``<TRACKIO_DIR>/<project>.db``, and reads ``TRACKIO_DIR`` once,
when it is first imported. So the first trackio run of a process picks the directory: this
backend sets ``TRACKIO_DIR=<folder>/trackio`` when trackio is not imported yet and the variable
is not set; otherwise trackio keeps the directory it has (an explicit ``TRACKIO_DIR``, or the
first tracker's folder) and a warning says where the run goes. ``directory`` tells.

- metrics: ``run.log(scalars, step=step)``, names unchanged;
- the configuration: ``config=`` of ``trackio.init``, once;
- samples: a ``trackio.Table`` (columns prompt, completion, reward) under the key ``samples``.

trackio's dashboard is not launched (``embed=False``) and its CPU / GPU monitors are off:
``trackio show --project <project>`` (with the same ``TRACKIO_DIR``) opens the dashboard.
trackio holds one current run per process: a second tracker with trackio finishes the first
one's run. **Resume** (``resume_step=k``): trackio can reopen a run but not delete its logged
steps, so a new run ``<run_name>-resume<k>`` is started in the project.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlblocks.tracking.backend import BACKENDS, require
from rlblocks.tracking.wandb import Wandb


class Trackio:
    """A trackio run in project ``project``, stored under ``folder / "trackio"`` (see module)."""

    name = "trackio"

    def __init__(self, folder: str | Path, *, project: str, run_name: str, **_: Any) -> None:
        wanted = (Path(folder) / "trackio").resolve()
        if "trackio" not in sys.modules and "TRACKIO_DIR" not in os.environ:
            os.environ["TRACKIO_DIR"] = str(wanted)
        self.library = require("trackio")
        self.directory = Path(self.library.utils.TRACKIO_DIR).resolve()
        if self.directory != wanted:
            warnings.warn(
                f"trackio writes to {self.directory}, not {wanted}: trackio reads TRACKIO_DIR "
                "once per process",
                stacklevel=2,
            )
        self.project = project
        self.run_name = run_name
        self.run: Any = None

    def start(self, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        """Open the Trackio run and record the configuration (a resumed run continues from
        ``resume_step``)."""
        name = self.run_name if resume_step is None else f"{self.run_name}-resume{resume_step}"
        self.run = self.library.init(
            project=self.project,
            name=name,
            config=dict(config),
            resume="never",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    # trackio copies W&B's run API: logging a step, a samples table, and finishing are Wandb's.
    log_metrics = Wandb.log_metrics
    log_samples = Wandb.log_samples
    close = Wandb.close


BACKENDS.register("trackio", (Trackio, "trackio"))
