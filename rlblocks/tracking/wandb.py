"""Weights & Biases, offline: a run folder under ``<folder>/wandb``, never a network call.

``wandb.init(mode="offline", dir=folder)`` writes ``<folder>/wandb/offline-run-<time>-<id>/``:
the whole run is in its ``run-<id>.wandb`` transaction log (protobuf records: the run with its
configuration, one history record per step, the summary), the samples tables as JSON under
``files/media/table/``. ``wandb sync <that folder>`` uploads it later; until then nothing
leaves the machine.

- metrics: ``run.log(scalars, step=step)``, names unchanged (W&B groups ``reward/mean`` under a
  ``reward`` section by the slash, the name stays ``reward/mean``);
- the configuration: ``config=`` of ``wandb.init``, once;
- samples: a ``wandb.Table`` (columns prompt, completion, reward) under the key ``samples``.

**Resume** (``resume_step=k``): an offline run cannot be resumed (W&B resumes a run on its
server), so a new offline run named ``<run_name>-resume<k>`` is started, its steps begin at
``k`` and it carries the tag ``resumed-at-step-<k>``; after ``wandb sync`` the two runs sit side
by side, the first one's steps >= k left as they were logged.

W&B's own settings (``WANDB_*`` environment variables, ``~/.config/wandb``) are left alone:
set ``WANDB_CACHE_DIR`` / ``WANDB_DATA_DIR`` to keep its caches and logs elsewhere than home.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlblocks.tracking.backend import BACKENDS, require
from rlblocks.tracking.samples import Sample


class Wandb:
    """An offline W&B run inside ``folder`` (the run folder: ``run.dir``'s parent)."""

    name = "wandb"

    def __init__(self, folder: str | Path, *, project: str, run_name: str, **_: Any) -> None:
        self.library = require("wandb")
        self.folder = Path(folder)
        self.project = project
        self.run_name = run_name
        self.run: Any = None

    def start(self, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        """Open the Wandb run and record the configuration (a resumed run continues from
        ``resume_step``)."""
        resumed = resume_step is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        self.run = self.library.init(
            project=self.project,
            name=f"{self.run_name}-resume{resume_step}" if resumed else self.run_name,
            dir=str(self.folder),
            mode="offline",
            config=dict(config),
            tags=[f"resumed-at-step-{resume_step}"] if resumed else None,
            reinit="create_new",  # several trackers (or a notebook's reruns) may hold runs
        )

    # W&B's run API, which trackio copies: `Trackio` takes these three methods as they are
    # (they need only ``self.run`` and ``self.library``, the imported module).

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log one step's scalar metrics."""
        self.run.log(dict(scalars), step=step)

    def log_samples(self, step: int, rows: Sequence[Sample]) -> None:
        """Log a table of sampled completions at ``step``."""
        log_samples_table(self.library, self.run, step, rows)

    def close(self) -> None:
        """Flush and finish the run; a second call does nothing."""
        if self.run is not None:
            self.run.finish()
            self.run = None


def log_samples_table(library: Any, run: Any, step: int, rows: Sequence[Sample]) -> None:
    """Log ``rows`` as a ``library.Table`` (columns prompt, completion, reward) under the key
    ``samples`` of ``run`` at ``step``: how W&B and trackio (which copies W&B's API) take it."""
    table = library.Table(columns=["prompt", "completion", "reward"], data=[list(r) for r in rows])
    run.log({"samples": table}, step=step)


BACKENDS.register("wandb", (Wandb, "wandb"))
