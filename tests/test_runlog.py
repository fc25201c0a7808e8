import json

import torch

from rlblocks.runlog import RunLog, read_metrics


def test_runlog_appends_flushed_json_lines(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = RunLog(path)
    log.log(0, {"reward/mean": torch.tensor(0.25), "kl": 0.0})
    # Written at once: a crash after this line loses nothing already logged.
    assert json.loads(path.read_text()) == {"step": 0, "reward/mean": 0.25, "kl": 0.0}
    log.log(1, {"reward/mean": 0.5})
    assert read_metrics(path) == log.records
    assert [r["step"] for r in log.records] == [0, 1]
