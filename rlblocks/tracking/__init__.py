"""Tracking: one logger for every recipe and the dashboard, with the same metric names everywhere.

    tracker = rb.tracking.Tracker("runs/grpo", report_to=("tensorboard", "mlflow"))
    rb.recipes.grpo(..., run=rb.run.RunOptions(tracker=tracker))
    tracker.close()

``metrics.jsonl`` is always written (when there is a folder); TensorBoard, Weights & Biases
(offline), MLflow (a local SQLite store) and trackio (local) are optional backends, picked by
name in ``report_to`` like TRL's; a notebook ``Dashboard`` is a backend too. Each backend's
library is imported only when it is asked for: ``pip install "rlblocks[tracking]"`` installs
all four. What each one writes and how it resumes: docs/tracking.md.
"""

from rlblocks.tracking.backend import BACKENDS, TrackingBackend
from rlblocks.tracking.jsonl import JsonlFiles
from rlblocks.tracking.mlflow import MLflow
from rlblocks.tracking.prometheus import Prometheus
from rlblocks.tracking.samples import Sample, pick_samples
from rlblocks.tracking.tensorboard import TensorBoard
from rlblocks.tracking.tracker import Tracker
from rlblocks.tracking.trackio import Trackio
from rlblocks.tracking.wandb import Wandb

__all__ = [
    "BACKENDS",
    "JsonlFiles",
    "MLflow",
    "Prometheus",
    "Sample",
    "TensorBoard",
    "Tracker",
    "TrackingBackend",
    "Trackio",
    "Wandb",
    "pick_samples",
]
