"""A save that fails in the middle of the optimizer's shard (a full disk, a file size limit)
raises `CheckpointError` naming the file, and leaves no partial folder: the checkpoint of
step 0 is all there is, as it was.

Real failures, in a process of their own (`save_job.py`): a 1400 KiB tmpfs mounted as the
checkpoint root in a user and mount namespace of its own (``unshare -rm``), and
``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored (a write past it fails with EFBIG). The tiny policy's
step-0 checkpoint takes 488 KiB, step 1's files before its shard about 425 KiB, the shard
808 KiB (two float32 AdamW moments per weight): the tmpfs fills up inside the shard, and a
600 000-byte limit passes ``model.safetensors`` (398 176 bytes) and stops the shard.

torch's DCP reports such a failure as a ``CheckpointException``, a ``BaseException`` that a
plain ``except Exception`` lets through with the partial folder left behind.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from resume_helpers import ENV

JOB = str(Path(__file__).with_name("save_job.py"))
SHARD = "policy/state/shard-00001-model-00001-of-00001.safetensors"


def _outcome(process: subprocess.CompletedProcess) -> dict:
    assert process.returncode == 0, process.stderr[-3000:]  # nothing but CheckpointError
    return json.loads(process.stdout.splitlines()[-1])


def _assert_failed_cleanly(outcome: dict, cause: str) -> None:
    error = outcome["error"]
    assert error is not None, "the save went through"
    assert error.startswith("Checkpointer.save: could not write the checkpoint of step 1")
    assert f".partial-step-00000001/{SHARD}" in error and cause in error, error
    assert "untouched: [0]" in error
    assert outcome["steps"] == [0]
    # no partial folder: the checkpoint of step 0 and the folder's lock file (it stays)
    assert {p.split("/")[0] for p in outcome["paths"]} == {".checkpointer.lock", "step-00000000"}


def _namespaces_work() -> bool:
    probe = subprocess.run(["unshare", "-r", "-m", "true"], check=False, capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _namespaces_work(), reason="unshare -rm: no user namespaces here")
def test_a_full_disk_inside_the_optimizer_shard(tmp_path):
    mount = 'mount -t tmpfs -o size=1400k tmpfs "$1" && exec "$2" "$3" "$1"'
    command = ["unshare", "-r", "-m", "sh", "-c", mount, "sh", str(tmp_path), sys.executable, JOB]
    process = subprocess.run(
        command, check=False, env=ENV, capture_output=True, text=True, timeout=300
    )
    _assert_failed_cleanly(_outcome(process), "No space left on device")


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, 600_000))


def test_a_file_size_limit_inside_the_optimizer_shard(tmp_path):
    process = subprocess.run(
        [sys.executable, JOB, str(tmp_path / "ckpt")],
        check=False,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit_file_size,
    )
    _assert_failed_cleanly(_outcome(process), "File too large")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".checkpointer.lock",
        "step-00000000",
    ]
