"""TensorBoard: event files under ``<folder>/tensorboard``, written by torch's ``SummaryWriter``.

- metrics: one scalar per name and step (``add_scalar(name, value, step)``);
- the configuration: once, as a JSON text summary ``config`` at the run's first step;
- samples: a Markdown table as a text summary ``samples`` at the step.

**Resume** (``resume_step=k``): the writer opens with ``purge_step=k``; TensorBoard's readers
then hide every event with step >= k written before, so the resumed run continues one curve
with no step twice.

View with ``tensorboard --logdir <folder>/tensorboard``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlblocks.tracking.backend import BACKENDS, require
from rlblocks.tracking.samples import Sample


class TensorBoard:
    """Writes a run's event files into ``folder / "tensorboard"``."""

    name = "tensorboard"

    def __init__(self, folder: str | Path, **_: Any) -> None:
        require("tensorboard")  # torch.utils.tensorboard imports it
        self.log_dir = Path(folder) / "tensorboard"
        self.writer: Any = None

    def start(self, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        """Open the TensorBoard run and record the configuration (a resumed run continues from
        ``resume_step``)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.log_dir), purge_step=resume_step)
        text = json.dumps(dict(config), indent=2, default=str)
        self.writer.add_text("config", _code(text), global_step=resume_step or 0)

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log one step's scalar metrics."""
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def log_samples(self, step: int, rows: Sequence[Sample]) -> None:
        """Log a table of sampled completions at ``step``."""
        self.writer.add_text("samples", markdown_table(rows), global_step=step)

    def close(self) -> None:
        """Flush and finish the run; a second call does nothing."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def markdown_table(rows: Sequence[Sample]) -> str:
    """The samples as a Markdown table (TensorBoard renders text summaries as Markdown)."""

    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| prompt | completion | reward |", "|---|---|---|"]
    lines += [f"| {cell(r.prompt)} | {cell(r.completion)} | {cell(r.reward)} |" for r in rows]
    return "\n".join(lines)


def _code(text: str) -> str:
    # Indented by four spaces: a Markdown code block, so the JSON shows as written.
    return "\n".join("    " + line for line in text.splitlines())


BACKENDS.register("tensorboard", (TensorBoard, "tensorboard"))
