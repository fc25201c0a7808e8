import json
import re

import pytest
import torch

from rlblocks.tracking.runlog import RunLog, read_metrics


def test_runlog_appends_flushed_json_lines(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = RunLog(path)
    log.log(0, {"reward/mean": torch.tensor(0.25), "kl": 0.0})
    # Written at once: a crash after this line loses nothing already logged.
    assert json.loads(path.read_text()) == {"step": 0, "reward/mean": 0.25, "kl": 0.0}
    log.log(1, {"reward/mean": 0.5})
    assert read_metrics(path) == log.records
    assert [r["step"] for r in log.records] == [0, 1]


def test_plain_makes_tensors_and_numpy_values_json_values():
    import numpy as np

    from rlblocks.tracking.runlog import plain

    assert plain(torch.tensor([0.5])) == 0.5 and plain(np.float32(1.5)) == 1.5
    assert plain(torch.tensor([1, 2])) == [1, 2] and plain(np.array([[2.0, 3.0]])) == [[2.0, 3.0]]
    assert plain("text") == "text" and plain(None) is None


def test_truncate_keeps_the_steps_before_and_rewrites_in_place(tmp_path):
    from rlblocks.tracking.runlog import truncate

    path = tmp_path / "metrics.jsonl"
    log = RunLog(path)
    for step in range(4):
        log.log(step, {"x": float(step)})
    assert truncate(path, 2) == log.records[:2] == read_metrics(path)
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left
    assert truncate(tmp_path / "missing.jsonl", 2) == []
    assert not (tmp_path / "missing.jsonl").exists()


def test_read_metrics_skips_a_half_written_last_line_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = RunLog(path)
    for step in range(2):
        log.log(step, {"x": float(step)})
    with path.open("a") as f:
        f.write('{"step": 2, "x": 2.')  # the run was killed in the middle of this write
    with pytest.warns(UserWarning, match=re.escape(str(path)) + r", line 3: skipped a half-writ"):
        assert read_metrics(path) == log.records


def test_read_metrics_names_file_and_line_of_a_broken_line_before_the_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "x": }\n{"step": 2}\n')
    with pytest.raises(ValueError, match=re.escape(str(path)) + r", line 2: not a metrics record"):
        read_metrics(path)
    # A last line that did get its newline was written whole: broken, not half-written.
    path.write_text('{"step": 0}\n{"step": 1, "x": }\n')
    with pytest.raises(ValueError, match=r", line 2: not a metrics record"):
        read_metrics(path)
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r", line 2: expected a JSON object"):
        read_metrics(path)


def test_metrics_frame_from_a_file_and_from_records(tmp_path):
    from rlblocks.tracking.runlog import metrics_frame

    log = RunLog(tmp_path / "metrics.jsonl")
    log.log(0, {"reward/mean": 0.25, "loss": torch.tensor(1.5)})
    log.log(1, {"reward/mean": 0.75, "kl": 0.1})  # no loss at step 1, a kl from step 1 on
    frame = metrics_frame(tmp_path / "metrics.jsonl")
    assert list(frame.columns) == ["step", "reward/mean", "loss", "kl"]
    assert frame["step"].tolist() == [0, 1] and frame["reward/mean"].tolist() == [0.25, 0.75]
    assert frame["loss"].iloc[0] == 1.5 and frame["loss"].isna().tolist() == [False, True]
    assert metrics_frame(log.records).equals(frame)
