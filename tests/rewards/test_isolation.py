"""`per_sample(fn, pool=ProcessPool(...))`: rows in real worker processes that a timeout kills.

Every case runs real processes (no fakes) and ends by checking that nothing it started outlives
it: the test process is made a child subreaper, so a grandchild whose worker was killed is
re-parented to it instead of disappearing from view, and every live descendant and every thread
started during the test is an error.

What thread mode does with the same rewards, not asserted because it is the leak this module
exists to avoid: a spinning row's thread keeps one core busy for the life of the process, and a
``sleep 60`` started by a row outlives it by a minute.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from proc_helpers import live_descendants, processes

from rlblocks.rewards.guard import RewardRowError, per_sample
from rlblocks.rewards.isolation import ProcessPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

LIMIT = 0.3  # seconds: a row's time limit, short to keep the suite fast
PR_SET_CHILD_SUBREAPER = 36


def _alive(pid: int) -> bool:
    return processes().get(pid, (0, "X"))[1] not in "ZX"


def _gone_within(pids: list[int], seconds: float = 2.0) -> bool:
    """True once none of ``pids`` is alive (SIGKILL is delivered, not instant)."""
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(autouse=True)
def no_leftovers():
    """Fail the test if a process or thread it started is still alive after it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    me, threads_before = os.getpid(), set(threading.enumerate())
    before = live_descendants(me)
    yield
    deadline = time.monotonic() + 2.0
    while (left := live_descendants(me) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid, (ppid, state) in processes().items():  # orphans re-parented to us: reap them
        if ppid == me and state == "Z":
            os.waitpid(pid, os.WNOHANG)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    assert not left, f"processes outlived the test: {sorted(left)}"
    assert set(threading.enumerate()) <= threads_before, "threads outlived the test"


@pytest.fixture
def pool(no_leftovers):
    with ProcessPool(workers=1) as pool:
        yield pool


def test_matches_thread_mode_on_normal_rows(make_rollouts, pool) -> None:
    bonus = {"a": 0.5}  # a notebook-style closure over a local: cloudpickle sends it by value

    def fn(completion: str, *, weight: float, prompt: str, **row: object) -> object:
        if completion == "raise":
            raise ValueError("cannot parse")
        if completion == "nan":
            return float("nan")
        return completion == "yes" if completion in ("yes", "no") else weight * len(prompt)

    completions = ["ab", "raise", "yes", "nan", "no", "abc"]
    ro = make_rollouts(completions, [{"weight": w + bonus["a"]} for w in range(6)])
    threads = per_sample(fn, fallback=-1.0)(ro)
    processes = per_sample(fn, fallback=-1.0, pool=pool)(ro)
    # Row 0: 0.5 * len("prompt 0") = 4; rows 1 and 3 fail; 2 and 4 are bools; row 5: 5.5 * 8.
    torch.testing.assert_close(processes.rewards, torch.tensor([4.0, -1, 1, -1, 0, 44]))
    torch.testing.assert_close(processes.rewards, threads.rewards)
    assert processes.metrics == threads.metrics
    assert per_sample(fn, fallback=-1.0, pool=pool, timeout=None)(ro).metrics == threads.metrics


def test_a_module_function_travels_by_reference(make_rollouts, pool, tmp_path, monkeypatch):
    # A function of an importable module is pickled by name: the worker imports the module
    # from the caller's sys.path, which the pool sends along.
    (tmp_path / "user_reward.py").write_text("def score(c, **row):\n    return 2.0 * len(c)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from user_reward import score

    rewards, _ = per_sample(score, pool=pool)(make_rollouts(["a", "abc"]))
    torch.testing.assert_close(rewards, torch.tensor([2.0, 6.0]))


def test_a_function_the_workers_cannot_import_is_an_error(make_rollouts, pool, tmp_path):
    # Pickled by name from a module the workers cannot find: every row would fail the same
    # way, so the call raises instead of scoring a batch of fallbacks; the pool stays usable.
    (tmp_path / "gone_reward.py").write_text("def score(c, **row):\n    return 1.0\n")
    sys.path.insert(0, str(tmp_path))
    try:
        from gone_reward import score
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(RuntimeError, match="cannot load the reward function.*gone_reward"):
        per_sample(score, pool=pool)(make_rollouts(["a"]))
    assert per_sample(lambda c, **row: 3.0, pool=pool)(make_rollouts(["a"])).rewards == 3.0


def test_a_spinning_row_is_killed_and_its_worker_replaced(make_rollouts, pool, tmp_path):
    pid_file = tmp_path / "spinner"

    def fn(completion: str, **row: object) -> float:
        if completion == "spin":
            pid_file.write_text(str(os.getpid()))
            while True:  # pure CPU, never returns: a thread could not be stopped
                pass
        return 1.0

    reward = per_sample(fn, timeout=LIMIT, fallback=-1.0, pool=pool)
    start = time.monotonic()
    rewards, metrics = reward(make_rollouts(["a", "spin", "b", "c"]))
    assert time.monotonic() - start < LIMIT + 2.0  # the deadline plus a new worker's start
    # The spinning row scores -1, the others 1: mean (1 - 1 + 1 + 1) / 4 = 0.5.
    torch.testing.assert_close(rewards, torch.tensor([1.0, -1.0, 1.0, 1.0]))
    assert metrics == {"reward/mean": 0.5, "reward/failures": 1.0, "reward/timeouts": 1.0}
    spinner = int(pid_file.read_text())
    assert _gone_within([spinner])  # nothing keeps spinning after the step
    assert spinner not in pool.pids and len(pool.pids) == 1  # a fresh worker took its place
    assert reward(make_rollouts(["c"])).rewards.tolist() == [1.0]


def test_programs_a_row_started_die_with_its_process_group(make_rollouts, pool, tmp_path):
    pid_file = tmp_path / "sleep"

    def fn(completion: str, **row: object) -> float:
        child = subprocess.Popen(["sleep", "60"])
        pid_file.write_text(str(child.pid))
        child.wait()  # hangs for a minute unless the group is killed
        return 1.0

    rewards, metrics = per_sample(fn, timeout=LIMIT, pool=pool)(make_rollouts(["a"]))
    assert rewards.tolist() == [0.0] and metrics["reward/timeouts"] == 1.0
    assert _gone_within([int(pid_file.read_text())])


@pytest.mark.parametrize("mode", ["calling thread", "threads", "processes"])
def test_a_forked_child_never_runs_the_callers_code(make_rollouts, tmp_path, mode) -> None:
    marker, me = tmp_path / "after-reward", os.getpid()

    def fn(completion: str, **row: object) -> float:
        child = os.fork()  # both copies return out of fn: the parent 1.0, the child 2.0
        if child:
            os.waitpid(child, 0)  # the copy that is not fn's caller must be gone by now
        return 1.0 if child else 2.0

    with ProcessPool() as pool:
        settings = {"calling thread": {"timeout": None}, "threads": {}, "processes": {"pool": pool}}
        rewards, metrics = per_sample(fn, **settings[mode])(make_rollouts(["a", "b", "c"]))
        with marker.open("a") as f:  # code after the reward call: must run exactly once
            f.write(f"{os.getpid()}\n")
        if os.getpid() != me:  # before the fork guard, a forked copy of this test got here
            os._exit(0)
    assert marker.read_text().split() == [str(me)]
    # Every row is answered by the process that called fn, never by its child (whose 2.0,
    # without the guard, reaches the caller's loop inline and the pool's socket in processes).
    assert rewards.tolist() == [1.0] * 3 and metrics["reward/failures"] == 0.0


@pytest.mark.parametrize("crash", ["segfault", "exit"])
def test_a_crashing_worker_fails_its_row_and_the_pool_recovers(
    make_rollouts, pool, caplog, crash
) -> None:
    def fn(completion: str, **row: object) -> float:
        if completion == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if completion == "exit":
            os._exit(3)
        return 1.0

    reward = per_sample(fn, fallback=-1.0, pool=pool)
    with caplog.at_level(logging.WARNING, logger="rlblocks.rewards.guard"):
        rewards, metrics = reward(make_rollouts(["a", crash, "b"]))
    torch.testing.assert_close(rewards, torch.tensor([1.0, -1.0, 1.0]))
    assert metrics["reward/failures"] == 1.0 and metrics["reward/timeouts"] == 0.0
    assert {"segfault": "SIGSEGV", "exit": "exited with code 3"}[crash] in caplog.text
    assert reward(make_rollouts(["c"])).rewards.tolist() == [1.0]


class Unloadable:
    """A score that pickles in the worker but fails to unpickle in the caller."""

    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise RuntimeError("this value cannot be rebuilt here")


def test_a_result_that_does_not_unpickle_fails_its_row_only(make_rollouts, pool, caplog) -> None:
    # The whole call used to raise from pickle.loads in the caller, every row's score lost.
    def fn(completion: str, **row: object) -> object:
        return Unloadable() if completion == "odd" else 1.0

    reward = per_sample(fn, fallback=-1.0, pool=pool)
    with caplog.at_level(logging.WARNING, logger="rlblocks.rewards.guard"):
        rewards, metrics = reward(make_rollouts(["a", "odd", "b"]))
    torch.testing.assert_close(rewards, torch.tensor([1.0, -1.0, 1.0]))
    assert metrics["reward/failures"] == 1.0
    assert "cannot be unpickled in this process" in caplog.text
    assert reward(make_rollouts(["c"])).rewards.tolist() == [1.0]  # the worker goes on


def test_raise_errors_chains_the_workers_exception(make_rollouts, pool) -> None:
    def fn(completion: str, **row: object) -> float:
        raise KeyError(completion)

    with pytest.raises(RewardRowError, match="row 0: KeyError: 'x'") as info:
        per_sample(fn, raise_errors=True, pool=pool)(make_rollouts(["x"]))
    assert isinstance(info.value.__cause__, KeyError)


def test_workers_live_across_calls_until_close(make_rollouts, no_leftovers) -> None:
    pool = ProcessPool(workers=2)
    reward = per_sample(lambda c, **row: 1.0, pool=pool)
    assert pool.pids == []  # started lazily, by the first call
    reward(make_rollouts(["a", "b"]))
    workers = pool.pids
    reward(make_rollouts(["a", "b", "c"]))
    assert sorted(pool.pids) == sorted(workers)  # the same workers, whichever was idle first
    assert all(_alive(pid) for pid in workers)
    pool.close()
    assert pool.pids == [] and _gone_within(workers)
    with pytest.raises(RuntimeError, match="closed"):
        reward(make_rollouts(["a"]))
    copy = pickle.loads(pickle.dumps(pool))  # a pickled pool is its settings: fresh, unstarted
    assert copy.workers == 2 and copy.pids == []


def test_workers_die_when_their_caller_is_killed(tmp_path) -> None:
    # The caller is SIGKILLed mid-row, so no clean-up of its own runs: the worker's watchdog
    # must notice and kill its group.
    script = textwrap.dedent("""
        import os, rlblocks.rewards.isolation as iso
        pool = iso.ProcessPool()
        def spin(c, **row):
            print(os.getpid(), flush=True)
            while True:
                pass
        pool.map(spin, ["a"], [{}], timeout=None)
    """)
    caller = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, cwd=tmp_path,
    )  # fmt: skip
    worker = int(caller.stdout.readline())
    caller.kill()
    caller.wait()
    caller.stdout.close()
    assert _gone_within([worker], seconds=3.0)


def test_bad_arguments(pool) -> None:
    with pytest.raises(ValueError, match="workers"):
        ProcessPool(workers=0)
    with pytest.raises(ValueError, match="max_workers"):
        per_sample(lambda c, **row: 1.0, pool=pool, max_workers=2)
