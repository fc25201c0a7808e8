"""A GRPO run on 2 Ray workers (FSDP2, gloo), killed and resumed: on 2 workers it equals the
uninterrupted run bitwise, on 1 worker it stays within float32's reduction-order noise.

Every run is a real driver process (`ray_resume_job.py`) that starts its own local Ray instance:
the uninterrupted run, a run whose driver is killed with SIGKILL right after a random step k,
and the resumed runs. The killed driver takes its Ray instance with it (Ray ties the GCS,
raylet and workers to the driver that started them; checked below), so no worker of the killed
run can still write into the checkpoint folder when the resumed run reads it.

The rollout engine lives in the driver with its own copy of the weights (synced from the
workers by the resharder) and samples with the driver's generator, restored from the
checkpoint's ``state.json``: the rollouts do not depend on the number of workers, which is what
lets a run resumed onto 1 worker be compared at all. An engine colocated with the policy in
each worker samples each worker's share of the prompts with that worker's generator (saved per
rank as ``rng-{rank}.json``): resumed on 2 workers it is bitwise too (the slow test).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from resume_helpers import ENV, assert_identical, assert_travelled_alike, result, untimed
from safetensors.torch import load_file

import rlblocks as rb

# Slow (a minute or more together on 2 cores): .ci/run runs them in a step of their own, keeping
# the default run under 15 minutes.
pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = Path(__file__).with_name("ray_resume_job.py")
STEPS = 4
# What makes a Ray instance run; its dashboard and runtime-env agents (also started by the
# driver) are left out: they notice the dead raylet and exit on their own, after Ray's GCS
# reconnection timeout (about a minute), holding no block and no file of the run meanwhile.
RAY_PROCESSES = ("gcs_server", "raylet", "ray::Worker")


def job(out: Path, workers: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, str(JOB), str(out), str(STEPS), "--workers", str(workers), *flags]
    env = {**ENV, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": _python_path()}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _python_path() -> str:
    """The driver and (inheriting its environment) the Ray workers import this checkout."""
    root = str(Path(rb.__file__).resolve().parents[1])
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


def finish(process: subprocess.Popen) -> None:
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]


def kill_driver_after(process: subprocess.Popen, line: str) -> None:
    """SIGKILL the driver as soon as it prints ``line``; its Ray instance must die with it."""
    for got in process.stdout:
        if got.strip() == line:
            ray = ray_processes(process.pid)
            process.send_signal(signal.SIGKILL)
            break
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, process.stderr.read()[-3000:]
    assert {"gcs_server", "raylet", "ray::Worker"} <= {p.name()[:11] for p in ray}
    _, alive = psutil.wait_procs(ray, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def ray_processes(pid: int) -> list[psutil.Process]:
    """The Ray instance's processes among ``pid``'s descendants (short-lived helpers that end
    while they are listed are skipped)."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.name().startswith(RAY_PROCESSES):
                found.append(child)
    return found


def killed_run(out: Path, *flags: str) -> int:
    """A run on 2 workers killed once step k is done (k >= 1: the checkpoint of step k - 1
    exists by then), while it writes the checkpoint of step k or trains step k + 1. Returns
    the step of the newest complete checkpoint it left."""
    k = random.randrange(1, STEPS - 1)
    kill_driver_after(job(out, 2, *flags), f"STEP {k}")
    saved = rb.checkpoint.Checkpointer(out / "checkpoints").steps()
    assert saved and saved[-1] < STEPS, (k, saved)  # it died before the end, with a checkpoint
    return saved[-1]


def test_a_killed_run_resumes_bitwise_on_two_workers_and_closely_on_one(tmp_path):
    full, two, one = tmp_path / "full", tmp_path / "two", tmp_path / "one"
    uninterrupted = job(full, 2)  # alongside the killed run: each has its own Ray instance
    start = killed_run(two)
    shutil.copytree(two, one)  # the same checkpoints, resumed twice
    model = one / "checkpoints" / f"step-{start:08d}" / "policy" / "model"
    at_start = load_file(model / "model.safetensors")
    finish(job(two, 2, "--resume"))
    finish(uninterrupted)
    assert_identical(result(two), result(full), steps=STEPS)
    finish(job(one, 1, "--resume"))
    assert_close_on_one_worker(result(one), result(full), at_start, resumed_at=start)


def assert_close_on_one_worker(got: dict, want: dict, at_start: dict, *, resumed_at: int):
    """The run resumed onto 1 worker against the 2-worker run.

    Resumed onto 1 worker, the run starts step ``resumed_at`` from the same bits: DCP moves the
    shards of the optimizer state into whole tensors and the weights come from the saved
    Hugging Face folder, with no arithmetic. What differs from there on is the order of float32
    additions: on 2 workers each gradient element is two partial sums (one per rank) added by
    FSDP's reduce-scatter, on 1 worker one sum; each differs by rounding, about 2⁻²⁴ ≈ 6e-8
    relative to the magnitudes added. AdamW divides the first moment by the root of the
    second, so an update does not depend on the gradient's scale, and a gradient element off
    by a relative r moves its update by about r·lr: ~1e-7·lr for most, more only for elements
    whose gradient nearly cancels, which weigh little in a norm. The moved weights change the
    next gradients by as little, so over the ≤ 3 resumed steps (4 AdamW updates each) the gap
    grows roughly linearly, to ~1e-5 of the distance the weights travel meanwhile (measured:
    5e-6 after 3 resumed steps). The test allows 1e-3: a hundredfold margin, while a real
    resume error (AdamW's moments lost, so that the first update moves every weight by ±lr as
    a first step does; a step skipped or repeated; the data one batch off) is off by about the
    travel itself (tests/trainer/test_checkpoint.py: lost moments end 0.9 to 1.2 of it away).

    The same for the metrics: float32 quantities (loss, gradient norm, KL, entropy, ratio mean)
    agree to ~1e-5 relative, asked to 1e-3. ``ratio_max`` is a maximum per micro-batch,
    averaged over micro-batches, which depend on the split over workers: not compared. Counts
    (rewards, lengths, optimizer steps) are equal: the driver's engine samples the same tokens
    unless a weight difference of ~1e-7 moves a probability across the uniform draw of one
    of the ~800 sampled tokens, a chance of ~1e-4 per run.
    """
    assert_travelled_alike(got["policy"], want["policy"], at_start, rel=1e-3)
    ha, hb = untimed(got["history"]), untimed(want["history"])
    assert len(ha) == len(hb) == STEPS
    assert ha[:resumed_at] == hb[:resumed_at]  # restored from the checkpoint's history
    for step in range(resumed_at, STEPS):
        assert ha[step].keys() == hb[step].keys(), step
        for key in ha[step].keys() - {"ratio_max"}:
            a, b = ha[step][key], hb[step][key]
            if key.startswith("mismatch/"):  # rounding noise itself: absolute
                assert abs(a - b) <= 1e-6, (step, key, a, b)
            else:
                assert a == pytest.approx(b, rel=1e-3), (step, key)


@pytest.mark.slow  # three more runs, ~40 s on 2 cores
def test_an_engine_colocated_in_the_workers_resumes_bitwise_on_two(tmp_path):
    # Each worker's engine samples with its own generator: restored from rng-{rank}.json.
    full, killed = tmp_path / "full", tmp_path / "killed"
    uninterrupted = job(full, 2, "--engine", "workers")
    killed_run(killed, "--engine", "workers")
    finish(job(killed, 2, "--engine", "workers", "--resume"))
    finish(uninterrupted)
    assert_identical(result(killed), result(full), steps=STEPS)
