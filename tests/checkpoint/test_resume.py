"""N steps == k steps + SIGKILL + resume + (N - k) steps, bitwise, for GRPO, PPO and DAPO.

Every run is a real process (`resume_job.py`): the uninterrupted run, a run killed with SIGKILL
right after a random step k (while it trains step k + 1 or writes its checkpoint), and the
resumed run. Metrics (timings aside) and final weights must be identical, not close: the resumed
run restores the weights, the optimizer and scheduler, the data position, the KL controller,
the resharder version and every random generator, so each floating-point operation repeats.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from resume_helpers import ENV, result
from resume_helpers import assert_identical as identical

import rlblocks as rb

JOB = Path(__file__).with_name("resume_job.py")
STEPS = 6


def job(recipe: str, out: Path, *flags: str, steps: int = STEPS) -> subprocess.Popen:
    cmd = [sys.executable, str(JOB), recipe, str(out), str(steps), *flags]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return out


def assert_identical(a: dict, b: dict) -> None:
    identical(a, b, steps=STEPS)


def kill_after(process: subprocess.Popen, line: str) -> None:
    """SIGKILL ``process`` as soon as it prints ``line``."""
    for got in process.stdout:
        if got.strip() == line:
            process.send_signal(signal.SIGKILL)
            break
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, process.stderr.read()[-3000:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The N-step run of each recipe, started together (each is one process)."""
    root = tmp_path_factory.mktemp("full")
    runs = {r: job(r, root / r) for r in ("grpo", "ppo", "dapo")}
    return {r: (finish(p), result(root / r))[1] for r, p in runs.items()}


@pytest.mark.parametrize("recipe", ["grpo", "ppo", "dapo"])
def test_killed_and_resumed_run_equals_the_uninterrupted_one(recipe, tmp_path, uninterrupted):
    # Killed once step k is done (k >= 1: the checkpoint of step k - 1 exists by then), while it
    # writes the checkpoint of step k or trains step k + 1.
    k = random.randrange(1, STEPS - 1)
    killed = job(recipe, tmp_path)
    kill_after(killed, f"STEP {k}")
    saved = rb.checkpoint.Checkpointer(tmp_path / "checkpoints").steps()
    assert saved and saved[-1] < STEPS, (k, saved)  # it died before the end, with a checkpoint
    finish(job(recipe, tmp_path, "--resume"))
    assert_identical(result(tmp_path), uninterrupted[recipe])


def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(tmp_path, uninterrupted):
    # Every 100 steps: the only checkpoint when it dies in step 2 is the initial one (step 0).
    killed = job("ppo", tmp_path, "--every", "100")
    kill_after(killed, "STEP 1")
    assert rb.checkpoint.Checkpointer(tmp_path / "checkpoints").steps() == [0]
    finish(job("ppo", tmp_path, "--resume", "--every", "100"))
    assert_identical(result(tmp_path), uninterrupted["ppo"])


def test_resume_without_a_checkpoint_is_refused_and_a_used_folder_too(tmp_path):
    process = job("grpo", tmp_path, "--resume", steps=2)
    _, err = process.communicate(timeout=300)
    assert process.returncode != 0 and "holds no complete checkpoint" in err
    finish(job("grpo", tmp_path, steps=2))
    process = job("grpo", tmp_path, steps=2)  # the same folder, without --resume
    _, err = process.communicate(timeout=300)
    assert process.returncode != 0 and "already holds checkpoints" in err


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_selected(tmp_path, uninterrupted):
    process = job("dapo", tmp_path, "--hang-in-save", "3")  # the 3rd save hangs half-written
    kill_after(process, "SAVING")
    root = tmp_path / "checkpoints"
    assert (root / ".partial-step-00000003" / "policy" / "model").is_dir()  # written in part
    assert rb.checkpoint.Checkpointer(root).steps() == [1, 2]
    finish(job("dapo", tmp_path, "--resume"))  # resumes from 2, sweeps the partial folder
    assert not (root / ".partial-step-00000003").exists()
    assert_identical(result(tmp_path), uninterrupted["dapo"])


def test_a_save_that_runs_out_of_space_fails_loudly_and_loses_nothing(tmp_path, uninterrupted):
    # 200 kB: the files of a checkpoint of the tiny model include a 398 kB model.safetensors,
    # so the save of step 2 fails in the middle, as on a full disk (EFBIG instead of ENOSPC).
    process = job("ppo", tmp_path, "--fsize-limit", str(200_000))
    _, err = process.communicate(timeout=300)
    assert process.returncode == 1
    assert "CheckpointError: Checkpointer.save: could not write the checkpoint of step 2" in err, (
        err[-2000:]
    )
    assert "File too large" in err and "untouched: [0, 1]" in err
    root = tmp_path / "checkpoints"
    assert rb.checkpoint.Checkpointer(root).steps() == [0, 1]
    # no partial folder left (the run's lock file stays: rlblocks.checkpoint.lock)
    assert sorted(p.name for p in root.iterdir()) == [
        ".checkpointer.lock",
        "step-00000000",
        "step-00000001",
    ]
    finish(job("ppo", tmp_path, "--resume"))
    assert_identical(result(tmp_path), uninterrupted["ppo"])
