"""One writer per run folder (`rlblocks.checkpoint.lock`): a second run or a second tracker on
a folder fails at once, naming the folder and the holder; a closed, collected or killed holder
never blocks. The holders are real: a run in another process (tests/counting_run.py, waiting
in the middle of its run), a process killed with SIGKILL, a tracker left open in this one.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from counting_run import count
from resume_helpers import ENV

import rlblocks as rb
from rlblocks.checkpoint.lock import FolderInUseError
from rlblocks.tracking.runlog import read_metrics

JOB = Path(__file__).parents[1] / "counting_run.py"


def holder(folder: Path, *flags: str, steps: int = 4) -> subprocess.Popen:
    """A run of ``steps`` steps in ``folder``, in its own process, waiting in ``on_step`` of
    step index 1 (after the checkpoint of step 1, before that of step 2)."""
    cmd = [sys.executable, str(JOB), str(folder), str(steps), "--wait-after", "1", *flags]
    process = subprocess.Popen(
        cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in process.stdout:
        if line.strip() == "WAITING":
            return process
    raise AssertionError(process.stderr.read()[-3000:])


def steps_logged(folder: Path) -> list[int]:
    return [r["step"] for r in read_metrics(folder / "metrics.jsonl")]


def test_a_second_run_on_a_folder_fails_at_once_and_the_first_goes_on(tmp_path):
    first = holder(tmp_path)
    try:
        stepped = []
        with pytest.raises(FolderInUseError) as error:
            count(tmp_path, steps=4, on_step=lambda i, m, r: stepped.append(i))
        message = str(error.value)
        assert message.startswith(f"Checkpointer: {tmp_path / 'checkpoints'} is in use by ")
        assert f"process {first.pid} (" in message and "counting_run.py" in message
        assert message.endswith("or give this run another folder")
        assert stepped == []  # refused before its first step
        (tmp_path / "go").touch()
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]  # it did not die in a rename
    assert out.split() == ["STEP", "2", "STEP", "3", "DONE"]
    assert steps_logged(tmp_path) == [0, 1, 2, 3]  # each step once: nothing mixed in
    assert rb.checkpoint.Checkpointer(tmp_path / "checkpoints").steps() == [3, 4]
    assert count(tmp_path, steps=5) == [1, 2, 3, 4, 5]  # the folder is free again: resumed


def test_a_holder_killed_with_sigkill_never_blocks(tmp_path):
    first = holder(tmp_path)
    with pytest.raises(FolderInUseError, match=f"process {first.pid} "):
        count(tmp_path, steps=4)  # held while it lives
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL
    # killed in on_step of step index 1, before that step's checkpoint (step 0: the initial one)
    assert rb.checkpoint.Checkpointer(tmp_path / "checkpoints").steps() == [0, 1]
    assert count(tmp_path, steps=4) == [1, 2, 3, 4]  # resumed at once from the killed run's
    assert steps_logged(tmp_path) == [0, 1, 2, 3]


def test_a_second_tracker_fails_at_once_until_the_first_is_closed(tmp_path):
    first = rb.tracking.Tracker(tmp_path)
    first.start({"run": 1})
    second = rb.tracking.Tracker(tmp_path)  # a notebook cell run again, the first still open
    with pytest.raises(FolderInUseError) as error:
        second.start({"run": 2})
    assert str(error.value).startswith(f"Tracker.start: {tmp_path} is in use by this process")
    assert "close the tracker that holds it" in str(error.value)
    first.log(0, {"x": 1.0})
    with pytest.raises(FolderInUseError):
        second.log(0, {"x": 2.0})  # log starts a tracker that was not started
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "x": 1.0}]  # step 0 once
    first.close()
    with rb.tracking.Tracker(tmp_path) as third:  # closed: the folder is free
        third.start({}, resume_step=1)
        third.log(1, {"x": 3.0})
    rb.tracking.Tracker(tmp_path).start({}, resume_step=2)  # left open, then collected
    gc.collect()
    rb.tracking.Tracker(tmp_path).start({}, resume_step=2)
    assert steps_logged(tmp_path) == [0, 1]


def test_a_tracker_in_another_process_is_named_and_its_records_kept(tmp_path):
    first = holder(tmp_path)
    try:
        with pytest.raises(FolderInUseError, match=rf"in use by process {first.pid} \("):
            rb.tracking.Tracker(tmp_path).start({}, resume_step=1)  # would cut the live file
        assert steps_logged(tmp_path) == [0, 1]
    finally:
        first.kill()
        first.wait(timeout=60)


def test_two_cli_runs_on_one_out_the_second_fails_before_building(tmp_path, monkeypatch):
    from rlblocks.app import train

    first = holder(tmp_path)  # holds tmp_path/checkpoints, as the CLI's run does
    monkeypatch.setattr(train, "build", lambda config: pytest.fail("built a second run"))
    try:
        with pytest.raises(SystemExit, match=rf"is in use by process {first.pid} \("):
            train.main(["--out", str(tmp_path), "--steps", "2", "--resume"])
    finally:
        first.kill()
        first.wait(timeout=60)
