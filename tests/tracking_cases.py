"""A scripted run logged through a Tracker: the cases every tracking backend test shares.

Every backend test logs the same four steps (:func:`log_script`) and reads back what the backend
wrote with the backend's own reader; :func:`scalar_steps` is the JSONL side of the comparison.
The values are dyadic fractions (0.25, 1.5, ...): TensorBoard stores float32, and these are
exact in float32 and float64 alike, so every backend must give back exactly the logged value.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from rlblocks.rollouts import Rollouts
from rlblocks.tracking import Tracker
from rlblocks.tracking.runlog import read_metrics

CONFIG = {"lr": 1e-5, "group_size": 2, "model": {"name": "tiny", "dtype": "float32"}}
NAMES = ("reward/mean", "time/update", "kl/token", "loss", "grad_norm")
SAMPLES_EVERY = 2


def metrics_at(step: int, offset: float = 0.0) -> dict[str, Any]:
    """The step's metrics as a recipe reports them: tensors, floats, a NaN, non-scalars."""
    return {
        "reward/mean": torch.tensor(0.25 * step + offset),
        "time/update": 1.5 + step,
        "kl/token": 0.125 * step,
        "loss": torch.tensor([-0.5 * step]),  # one element: a scalar
        "grad_norm": math.nan if step == 1 else 2.0,  # a step the NaN guard skipped
        "rewards": torch.tensor([1.0, 0.0, 0.5, 0.25]),  # per row: JSONL only
        "note": "warmup" if step == 0 else None,  # text: JSONL only
    }


def batch() -> Rollouts:
    """Two prompt groups of two rows; rewards in ``rollouts.rewards``."""
    return Rollouts.from_lists(
        [[1, 2], [1, 2], [3], [3]],
        [[4, 5], [6], [7, 8, 9], [10]],
        group_ids=[0, 0, 1, 1],
        prompts=["What is 1+1?", "What is 1+1?", "Is 2 < 3?", "Is 2 < 3?"],
        completions=["2", "3", "yes | sure", "no"],
    ).replace(rewards=torch.tensor([1.0, 0.0, 0.5, 0.25]))


#: What the samples table holds at every samples step: one row per group first (rows 0, 2).
SAMPLE_ROWS = [("What is 1+1?", "2", 1.0), ("Is 2 < 3?", "yes | sure", 0.5)]


def log_script(
    folder: Path,
    report_to: Any,
    *,
    steps: range = range(4),
    resume_step: int | None = None,
    offset: float = 0.0,
    run_name: str = "run",
) -> Tracker:
    """Log ``steps`` through a closed Tracker: samples (2 rows) at even steps."""
    with Tracker(
        folder, report_to=report_to, run_name=run_name, samples_every=SAMPLES_EVERY, samples=2
    ) as tracker:
        tracker.start(CONFIG, resume_step=resume_step)
        for step in steps:
            tracker(step, metrics_at(step, offset), batch())
    return tracker


def comparable(value: float) -> float | str:
    """NaN as a string, so that dicts with NaN compare equal."""
    return "nan" if math.isnan(value) else float(value)


def scalar_steps(folder: Path) -> dict[int, dict[str, float | str]]:
    """``metrics.jsonl``'s scalars by step: what every backend must give back."""
    return {
        r["step"]: {k: comparable(v) for k, v in r.items() if k in NAMES}
        for r in read_metrics(folder / "metrics.jsonl")
    }
