"""trackio: its local SQLite store, read back with trackio's own SQLiteStorage.

trackio reads ``TRACKIO_DIR`` once per process, at import; the tests in this process share the
first tracker's directory (``backend.directory``), each with its own project. A subprocess
checks that a fresh process puts the store into ``<folder>/trackio``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tracking_cases import CONFIG, NAMES, SAMPLE_ROWS, batch, comparable, metrics_at, scalar_steps

from rlblocks.base.extras import is_installed
from rlblocks.tracking import Tracker

# Not imported at collection: trackio reads TRACKIO_DIR once, and the first tracker sets it.
pytestmark = pytest.mark.skipif(not is_installed("trackio"), reason="trackio is not installed")


def log_trackio(folder: Path, project: str, steps=range(4), resume_step=None, offset=0.0):
    tracker = Tracker(
        folder, report_to="trackio", project=project, run_name="run", samples_every=2, samples=2
    )
    with tracker:
        tracker.start(CONFIG, resume_step=resume_step)
        for step in steps:
            tracker(step, metrics_at(step, offset), batch())
    return tracker.backends[0]


def test_store_holds_the_jsonl_metrics_config_and_samples(tmp_path):
    from trackio.sqlite_storage import SQLiteStorage

    log_trackio(tmp_path, "tracking-test")
    assert SQLiteStorage.get_runs("tracking-test") == ["run"]
    logs = SQLiteStorage.get_logs("tracking-test", "run")
    metrics: dict[int, dict[str, float | str]] = {}
    tables = {}
    for row in logs:
        if "samples" in row:
            tables[row["step"]] = row["samples"]["_value"]
        values = {k: comparable(v) for k, v in row.items() if k in NAMES}
        if values:
            assert not set(values) & set(metrics.get(row["step"], {})), "a step twice"
            metrics.setdefault(row["step"], {}).update(values)
    assert metrics == scalar_steps(tmp_path)
    assert sorted(tables) == [0, 2]
    assert [(r["prompt"], r["completion"], r["reward"]) for r in tables[2]] == SAMPLE_ROWS
    config = SQLiteStorage.get_run_config("tracking-test", "run")
    assert {k: config[k] for k in CONFIG} == CONFIG


def test_resume_starts_a_new_run_from_the_checkpoint_step(tmp_path):
    from trackio.sqlite_storage import SQLiteStorage

    log_trackio(tmp_path, "tracking-resume")
    log_trackio(tmp_path, "tracking-resume", steps=range(2, 4), resume_step=2, offset=10.0)
    assert sorted(SQLiteStorage.get_runs("tracking-resume")) == ["run", "run-resume2"]
    steps = [r["step"] for r in SQLiteStorage.get_logs("tracking-resume", "run-resume2")]
    assert sorted(set(steps)) == [2, 3]


def test_a_fresh_process_stores_into_the_folder(tmp_path):
    code = (
        "import sys; from rlblocks.tracking import Tracker\n"
        "with Tracker(sys.argv[1], report_to='trackio', project='p') as t:\n"
        "    t.log(0, {'reward/mean': 0.5})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRACKIO_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert (tmp_path / "trackio" / "p.db").is_file()
