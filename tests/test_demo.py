"""The main job's plumbing, run on the tiny model: outputs are written and complete."""

import json

from rlblocks import demo
from rlblocks.runlog import read_metrics


def test_demo_smoke_run_writes_its_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--steps", "2", "--eval-size", "4", "--group-size", "2"]
    summary = demo.main(
        [*argv, "--prompts-per-step", "2", "--max-new-tokens", "4", "--out", str(out)]
    )
    assert set(summary) == {"before", "after", "steps", "train_minutes"}
    assert 0.0 <= summary["before"] <= 1.0 and 0.0 <= summary["after"] <= 1.0
    assert json.loads((out / "summary.json").read_text()) == summary
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for key in ("reward/mean", "accuracy", "response_length", "kl", "entropy", "grad_norm"):
        assert key in records[0], key
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_rejects_unknown_task():
    import pytest

    with pytest.raises(SystemExit):
        demo.parse_args(["--task", "chess"])
