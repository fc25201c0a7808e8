"""The stall watchdog with real stalls: a reward that sleeps, an engine that blocks, a rank that
never joins a collective, and a process the watchdog ends; each is named within its deadline
plus 5 s (the issue's bound), with the phase, the rows in flight and the stuck stack."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import count_prompts

import rlblocks as rb
from rlblocks.run import STALL_EXIT, RunOptions, Watchdog

ROOT = Path(__file__).resolve().parents[2]
SAMPLING = rb.SamplingParams(max_new_tokens=4)
BOUND = 5.0  # seconds past the deadline within which the stall must be named


def _prompts():
    return count_prompts(8)


def _grpo(reward_fn, watchdog, *, engine=None, steps=3):
    torch.manual_seed(0)
    policy = tiny_trainer(lr=1e-3)
    engine = engine or tiny_engine(policy, shared=True)
    batches = rb.data.PromptBatches(_prompts(), prompts_per_step=2, seed=0)
    return rb.recipes.grpo(
        policy, engine, reward_fn, batches, steps=steps, group_size=2, sampling=SAMPLING,
        run=RunOptions(progress=False, watchdog=watchdog),
    )  # fmt: skip


def _rewards(rollouts):
    return torch.zeros(len(rollouts)), {"reward/mean": 0.0}


def test_a_sleeping_reward_is_named_with_its_stack_within_its_deadline(tmp_path):
    started: dict[int, float] = {}
    calls = []

    def slow_reward(rollouts):
        calls.append(len(calls))
        if len(calls) == 2:  # step 1
            started[1] = time.monotonic()
            time.sleep(3.0)
        return _rewards(rollouts)

    stream = io.StringIO()
    watchdog = Watchdog({"reward": 1.0}, stream=stream, folder=tmp_path)
    _grpo(slow_reward, watchdog)
    # Reported at 1 s and again at 2 s (2 × the deadline), both for step 1's reward.
    assert [(phase, step) for _, phase, step in watchdog.stalls] == [("reward", 1)] * 2
    when = watchdog.stalls[0][0]
    assert 1.0 <= when - started[1] <= 1.0 + BOUND
    report = (tmp_path / "stall-step1-reward.txt").read_text()  # the latest report
    assert stream.getvalue() == "\n".join(watchdog.reports) + "\n" and report in stream.getvalue()
    assert "step 1 is stuck in phase 'reward'" in report
    assert "deadline of 1.0 s (set by you)" in report
    assert "in flight: rows: 4 (2 samples of 2 prompts" in report
    # The stuck thread's stack comes first and shows the sleeping reward.
    this_process = report.split("--- this process")[1]
    first_thread = this_process.split("\nThread ")[1]
    assert "in slow_reward" in first_thread and "time.sleep(3.0)" in first_thread


def test_a_deadline_is_derived_from_the_phase_s_earlier_steps():
    calls = []

    def reward(rollouts):
        calls.append(None)
        time.sleep(0.2 if len(calls) < 3 else 2.5)  # steps 0 and 1 take 0.2 s, step 2 2.5 s
        return _rewards(rollouts)

    stream = io.StringIO()
    # Only the reward's deadline is derived: the other phases get 60 s, so that a slow
    # machine's rollout or update is not what this test reports.
    others = dict.fromkeys(("rollout", "logprobs", "update", "sync", "checkpoint"), 60.0)
    watchdog = Watchdog(others, factor=3.0, floor=0.3, first=30.0, stream=stream)
    _grpo(reward, watchdog)
    # 3 × 0.2 s = 0.6 s: reported at 0.6, 1.2 and 2.4 s of the 2.5 s.
    assert {(phase, step) for _, phase, step in watchdog.stalls} == {("reward", 2)}
    assert "deadline of 0.6 s (3 × its longest so far, 0.2 s)" in stream.getvalue()


class BlockingEngine:
    """The tiny engine, whose second call blocks until released (a stuck engine)."""

    def __init__(self, engine, release: threading.Event):
        self.engine, self.release, self.calls = engine, release, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            self.release.wait(timeout=30)
        return self.engine.generate(*args, **kwargs)


def test_a_blocked_engine_is_named_with_the_rows_it_was_sampling():
    torch.manual_seed(0)
    policy = tiny_trainer(lr=1e-3)
    release = threading.Event()
    engine = BlockingEngine(tiny_engine(policy, shared=True), release)
    stream = io.StringIO()
    watchdog = Watchdog({"rollout": 1.0}, stream=stream)
    timer = threading.Timer(4.0, release.set)  # the stall ends on its own after 4 s
    timer.start()
    try:
        batches = rb.data.PromptBatches(_prompts(), prompts_per_step=2, seed=0)
        rb.recipes.grpo(policy, engine, _rewards, batches, steps=2, group_size=2,
                        sampling=SAMPLING, run=RunOptions(progress=False, watchdog=watchdog))  # fmt: skip
    finally:
        timer.cancel()
    assert {(phase, step) for _, phase, step in watchdog.stalls} == {("rollout", 1)}
    report = stream.getvalue()
    assert "in flight: rows: 4 (2 samples of 2 prompts, sampled by weights version 1)" in report
    assert "in generate" in report and "self.release.wait" in report


RANK = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    import rlblocks as rb
    rank, store, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    stacks = rb.run.watchdog.serve_stacks()  # where this process writes its stacks, signalled
    open(os.path.join(folder, f"where-{rank}"), "w").write(stacks)
    open(os.path.join(folder, f"pid-{rank}"), "w").write(str(os.getpid()))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    if rank == 1:
        def never_joins():
            time.sleep(4.0)  # late: rank 0 waits in its all_reduce meanwhile
        never_joins()
        dist.all_reduce(torch.ones(1))
    else:
        while not os.path.exists(os.path.join(folder, "pid-1")):
            time.sleep(0.05)
        time.sleep(0.2)  # pid-1 is written after where-1
        worker = rb.run.watchdog.SignalStacks(int(open(os.path.join(folder, "pid-1")).read()),
                                              open(os.path.join(folder, "where-1")).read())
        watchdog = rb.run.Watchdog({"update": 1.0}, workers={"rank 1": worker},
                                   folder=folder)
        watchdog.enter("update", 0)
        start = time.monotonic()
        dist.all_reduce(torch.ones(1))
        watchdog.leave("update", time.monotonic() - start)
        watchdog.close()
        print(f"named after {watchdog.stalls[0][0] - start:.2f} s", flush=True)
    dist.destroy_process_group()
    """
)


def test_a_rank_that_never_joins_the_collective_is_named_with_both_stacks(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    store = tmp_path / "store"
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(store), str(tmp_path)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    named = float(outs[0][0].split("named after ")[1].split(" s")[0])
    assert 1.0 <= named <= 1.0 + BOUND
    report = (tmp_path / "stall-step0-update.txt").read_text()
    assert "step 0 is stuck in phase 'update'" in report
    assert "all_reduce" in report.split("--- worker rank 1 ---")[0]  # rank 0 waits in it
    assert "never_joins" in report.split("--- worker rank 1 ---")[1]  # rank 1 is elsewhere


EXIT = textwrap.dedent(
    """
    import signal, sys, time, torch
    # Python's Ctrl-C handler, as an interactive session or a notebook kernel has it (a job
    # started in the background inherits SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, sys.argv[1])
    from builders import tiny_engine, tiny_trainer
    import rlblocks as rb
    torch.manual_seed(0)
    policy = tiny_trainer(lr=1e-3)
    engine = tiny_engine(policy, shared=True)
    def reward(rollouts):
        time.sleep(60)
        return torch.zeros(len(rollouts)), {}
    from toy_tasks import count_prompts
    batches = rb.data.PromptBatches(count_prompts(4), prompts_per_step=2)
    rb.recipes.grpo(policy, engine, reward, batches, steps=1, group_size=2,
                    sampling=rb.SamplingParams(max_new_tokens=4),
                    run=rb.run.RunOptions(progress=False, watchdog=rb.run.Watchdog(
                        {"reward": 1.0}, on_stall=sys.argv[2])))
    """
)


@pytest.mark.parametrize("on_stall", ["exit", pytest.param("interrupt", marks=pytest.mark.slow)])
def test_the_watchdog_ends_or_interrupts_a_stalled_process(tmp_path, on_stall):
    script = tmp_path / "stall.py"
    script.write_text(EXIT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(ROOT / "tests"), on_stall],
                          env=env, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert time.monotonic() - start < 50  # not the 60 s sleep
    assert "step 0 is stuck in phase 'reward'" in done.stderr
    if on_stall == "exit":
        assert done.returncode == STALL_EXIT
    else:
        assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"deadlines": {"reward": 0}}, "reward=0"),
        ({"deadlines": {"update": -5.0}}, "update=-5.0"),
        ({"deadlines": {"rewards": 10}}, r"no phase \['rewards'\]"),
        ({"floor": 0}, "floor=0"),
        ({"on_stall": "kill"}, "on_stall='kill'"),
        ({"poll": 1e-9}, r"poll=1e-09; the watcher wakes every poll seconds"),  # spins a core
        ({"poll": float("inf")}, "poll=inf"),  # would never look
        ({"poll": float("nan")}, "poll=nan"),
    ],
)
def test_bad_deadlines_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Watchdog(**kwargs)
