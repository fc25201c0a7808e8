"""The Tracker itself: metrics.jsonl, samples.jsonl, config.json, resume, report_to, Dashboard."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
from tracking_cases import CONFIG, SAMPLE_ROWS, batch, comparable, log_script, scalar_steps

from rlblocks.notebook import Dashboard
from rlblocks.tracking import BACKENDS, Tracker
from rlblocks.tracking.runlog import read_metrics


def test_jsonl_records_every_value_plain_and_samples_at_samples_steps(tmp_path):
    tracker = log_script(tmp_path, "none")
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert json.dumps(records) == json.dumps(tracker.records)  # NaN != NaN: compare the text
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    first = records[0]
    # tensors became numbers (one element) or lists; text and None are kept as logged
    assert first["reward/mean"] == 0.0 and first["loss"] == -0.0
    assert first["rewards"] == [1.0, 0.0, 0.5, 0.25] and first["note"] == "warmup"
    assert records[1]["note"] is None and math.isnan(records[1]["grad_norm"])
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 2, 2]  # samples_every=2, 2 rows each
    assert [(s["prompt"], s["completion"], s["reward"]) for s in samples[2:]] == SAMPLE_ROWS
    assert json.loads((tmp_path / "config.json").read_text()) == CONFIG


def test_an_existing_run_is_never_appended_to(tmp_path):
    log_script(tmp_path, "none")
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match="metrics.jsonl"):
        Tracker(tmp_path).start(CONFIG)
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_resume_drops_the_steps_after_the_checkpoint_and_keeps_the_rest(tmp_path):
    log_script(tmp_path, "none")  # steps 0..3, samples at 0 and 2
    tracker = log_script(tmp_path, "none", steps=range(2, 5), resume_step=2, offset=10.0)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[1]["reward/mean"] == 0.25 and records[2]["reward/mean"] == 10.5
    assert json.dumps(tracker.records) == json.dumps(records)  # the kept ones, then the new ones
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 2, 2, 4, 4]  # step 2's old rows are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tracker.lock",  # one tracker per folder (rlblocks.checkpoint.lock): it stays
        "config.json",
        "metrics.jsonl",
        "samples.jsonl",
    ]  # no temporary file left behind


def test_no_samples_without_rollouts_or_off_the_samples_steps(tmp_path):
    with Tracker(tmp_path, samples_every=3) as tracker:
        for step in range(4):
            tracker.log(step, {"reward/mean": 1.0}, batch() if step != 3 else None)
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in lines} == {0}  # step 3 had no rollouts
    assert (tmp_path / "config.json").read_text() == "{}\n"  # started implicitly


def test_dashboard_backend_gets_exactly_the_tracked_stream(tmp_path):
    dash = Dashboard(mode="terminal", file=io.StringIO(), samples=1)
    log_script(tmp_path, [dash])
    assert dash.closed  # the tracker closed it
    history = {
        h["step"]: {k: comparable(v) for k, v in h.items() if k != "step"} for h in dash.history
    }
    assert history == scalar_steps(tmp_path)  # the same steps, names and values, none added
    assert tuple(dash.samples[0]) == SAMPLE_ROWS[0] and dash._samples_step == 2


def test_close_is_idempotent_and_logging_after_it_fails(tmp_path):
    tracker = Tracker(None)
    tracker.log(0, {"x": 1})
    tracker.close()
    tracker.close()
    with pytest.raises(RuntimeError, match="closed"):
        tracker.log(1, {"x": 2})
    assert tracker.records == [{"step": 0, "x": 1}]


def test_report_to_names_and_errors(tmp_path):
    assert Tracker(tmp_path, report_to="none").backends == []
    assert Tracker(tmp_path, report_to=()).backends == []
    with pytest.raises(ValueError, match="unknown backend 'comet'"):
        Tracker(tmp_path, report_to="comet")
    with pytest.raises(ValueError, match="give the Tracker a folder"):
        Tracker(None, report_to="tensorboard")
    with pytest.raises(TypeError, match="not a tracking backend"):
        Tracker(tmp_path, report_to=[object()])
    installed = [b.name for b in Tracker(tmp_path, report_to="all").backends]
    assert set(installed) <= set(BACKENDS) and installed == sorted(
        installed, key=list(BACKENDS).index
    )


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_missing_backend_says_what_to_install(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # how Python marks a module as not importable
    with pytest.raises(ImportError, match=r'pip install "rlblocks\[tracking\]"'):
        Tracker(tmp_path, report_to=name)
    names = [b.name for b in Tracker(tmp_path, report_to="all").backends]
    assert name not in names  # "all" means every installed backend


def test_plot_reads_the_tracked_jsonl(tmp_path):
    import rlblocks as rb

    log_script(tmp_path, "none")
    rb.plot(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
