import json

import pytest
import torch

from rlblocks.runlog import RunLog, plot_metrics, read_metrics


def test_runlog_appends_flushed_json_lines(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = RunLog(path)
    log.log(0, {"reward/mean": torch.tensor(0.25), "kl": 0.0})
    # Written at once: a crash after this line loses nothing already logged.
    assert json.loads(path.read_text()) == {"step": 0, "reward/mean": 0.25, "kl": 0.0}
    log.log(1, {"reward/mean": 0.5})
    assert read_metrics(path) == log.records
    assert [r["step"] for r in log.records] == [0, 1]


def test_plot_metrics_draws_available_curves(tmp_path):
    records = [{"step": s, "reward/mean": s / 10, "grad_norm": 1.0 + s} for s in range(5)]
    out = plot_metrics(records, tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5000  # two drawn panels, not an empty canvas
    with pytest.raises(ValueError, match="none of the curves"):
        plot_metrics([{"step": 0, "other": 1.0}], tmp_path / "none.png")
