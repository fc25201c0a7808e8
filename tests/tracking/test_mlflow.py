"""MLflow: the local SQLite store and its artifacts, read back with MlflowClient."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tracking_cases import CONFIG, NAMES, SAMPLE_ROWS, comparable, log_script, scalar_steps

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")
from mlflow.tracking import MlflowClient

from rlblocks.tracking.mlflow import samples_file


def client_for(folder) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow' / 'mlflow.db'}")


def runs(client: MlflowClient) -> dict[str, object]:
    experiment = client.get_experiment_by_name("rlblocks")
    return {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}


def metric_steps(client: MlflowClient, run_id: str) -> dict[int, dict[str, float | str]]:
    out: dict[int, dict[str, float | str]] = {}
    for name in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, name):
            assert name not in out.setdefault(m.step, {}), f"step {m.step} twice in {name}"
            out[m.step][name] = comparable(m.value)
    return out


def test_store_holds_the_jsonl_metrics_config_and_samples(tmp_path):
    log_script(tmp_path, "mlflow")
    client = client_for(tmp_path)
    [run] = runs(client).values()
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert set(run.data.metrics) == set(NAMES)
    assert metric_steps(client, run.info.run_id) == scalar_steps(tmp_path)
    assert run.data.params == {
        "lr": "1e-05",
        "group_size": "2",
        "model.name": "tiny",
        "model.dtype": "float32",
    }
    downloaded = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "download")))
    assert sorted(p.name for p in (downloaded / "samples").iterdir()) == [
        "step_000000.json",
        "step_000002.json",
    ]
    assert json.loads((downloaded / "config.json").read_text()) == CONFIG
    # MlflowClient.load_table searches runs through MLflow's global tracking URI, not the
    # client's, so the table is read from its artifact (log_table's "split" JSON layout).
    table = json.loads((downloaded / samples_file(2)).read_text())
    assert table["columns"] == ["prompt", "completion", "reward"]
    assert [tuple(row) for row in table["data"]] == SAMPLE_ROWS


def test_resume_starts_a_new_run_tagged_with_the_step(tmp_path):
    log_script(tmp_path, "mlflow")
    log_script(tmp_path, "mlflow", steps=range(2, 4), resume_step=2, offset=10.0)
    client = client_for(tmp_path)
    by_name = runs(client)
    assert sorted(by_name) == ["run", "run-resume2"]
    resumed = by_name["run-resume2"]
    assert resumed.data.tags["resume_step"] == "2"
    assert sorted(metric_steps(client, resumed.info.run_id)) == [2, 3]
    assert metric_steps(client, resumed.info.run_id) == {
        s: r for s, r in scalar_steps(tmp_path).items() if s >= 2
    }
