"""The environment that keeps the tracking backends offline and out of the home folder."""

from __future__ import annotations

import os

import pytest

# Read when MLflow is imported (test collection, before any fixture): no telemetry file in ~.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture(autouse=True, scope="session")
def offline_backends(tmp_path_factory: pytest.TempPathFactory):
    """W&B offline and silent, its caches, trackio's directory and HOME in a temporary folder."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(name, str(home / name.lower()))
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        yield home
