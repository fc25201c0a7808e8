"""The run floor under a loop of one's own (rlblocks/run/loop.py, rlblocks/run/clock.py): the
clock, the metrics a run adds, and how the loop's control flow (``break``, ``continue``, the
data running out, ``on_step``) and its misuse end or record a step."""

from __future__ import annotations

import pytest

import rlblocks as rb
from rlblocks.run import Batches
from rlblocks.run.clock import PHASES, Clock, shared_metrics
from rlblocks.run.loop import Run

TIMES = {f"time/{phase}" for phase in PHASES}
SHARED = TIMES | {"reward/mean", "step_seconds", "response_length"}


class FakeTimer:
    """A clock that reads whatever the test set it to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rows(*lengths: int) -> rb.Rollouts:
    """Rows with responses of the given lengths (token id 5, prompt [1, 2])."""
    return rb.Rollouts.from_lists([[1, 2]] * len(lengths), [[5] * n for n in lengths])


# ---------------------------------------------------------------------- the clock
def test_clock_hand_worked_nested_phases_count_each_second_once():
    timer = FakeTimer()
    clock = Clock(timer)
    with clock("rollout"):  # t = 0
        timer.now = 2.0
        with clock("reward"):  # rollout 0 -> 2 (2 s), reward from 2
            timer.now = 2.5
        timer.now = 4.0  # reward 2 -> 2.5 (0.5 s), rollout again 2.5 -> 4 (1.5 s)
    timer.now = 10.0  # outside every phase: counted nowhere
    with clock("rollout"):  # a phase entered again adds up: 10 -> 11
        timer.now = 11.0
    scored = clock.timed("update", lambda x, *, y: x + y)
    timer.now = 20.0
    assert scored(1, y=2) == 3  # the call itself took no (fake) time
    assert clock.seconds == {
        "rollout": 2.0 + 1.5 + 1.0,
        "reward": 0.5,
        "logprobs": 0.0,
        "update": 0.0,
        "sync": 0.0,
    }
    with pytest.raises(ValueError, match="Clock: unknown phase 'train'"), clock("train"):
        pass


def test_clock_stops_a_phase_that_raised():
    timer = FakeTimer()
    clock = Clock(timer)
    with pytest.raises(RuntimeError), clock("update"):
        timer.now = 3.0
        raise RuntimeError
    timer.now = 7.0
    with clock("sync"):
        timer.now = 8.0
    assert (clock.seconds["update"], clock.seconds["sync"]) == (3.0, 1.0)


# ---------------------------------------------------------------------- the metrics it adds
def test_shared_metrics_move_the_trainers_scoring_out_of_the_update():
    clock = Clock(FakeTimer())
    clock.seconds |= {"rollout": 4.0, "reward": 1.0, "update": 3.0, "sync": 0.5}
    reported = {"reward/mean": 0.25, "seconds": 2.9, "logprob_seconds": 1.0}
    metrics = shared_metrics(reported, rows(2, 4), clock, step_seconds=9.0)
    # policy.step ran under "update" for 3 s, of which the trainer spent 1 s scoring π_old:
    # time/logprobs = 0 + 1, time/update = 3 − 1.
    assert {k: metrics[k] for k in sorted(TIMES)} == {
        "time/logprobs": 1.0,
        "time/reward": 1.0,
        "time/rollout": 4.0,
        "time/sync": 0.5,
        "time/update": 2.0,
    }
    assert metrics["step_seconds"] == 9.0
    assert metrics["response_length"] == 3.0  # (2 + 4) / 2
    assert metrics["reward/mean"] == 0.25 and "kl/token" not in metrics  # no KL term: no KL
    # No rows (DAPO's skipped step): no response length, still all five times.
    empty = shared_metrics({}, None, Clock(FakeTimer()), step_seconds=1.0)
    assert "response_length" not in empty and TIMES <= set(empty)
    assert all(empty[k] == 0.0 for k in TIMES)


@pytest.mark.parametrize(
    ("reported", "kl_token"),
    [
        ({"kl_loss": 0.2}, 0.2),  # rb.losses.kl_regularized's name
        ({"kl": 0.3}, 0.3),  # rb.losses.kl_loss composed by hand (the demo, docs)
        ({"kl_loss": 0.2, "kl": 0.3}, 0.2),  # kl_regularized's first
        ({"kl/token": 0.1, "kl_loss": 0.2}, 0.1),  # PPO measured its own: never overwritten
        ({"approx_kl": 0.4, "mismatch/kl": 0.5}, None),  # KL to π_old / π_rollout: not this
    ],
)
def test_kl_to_the_reference_gets_the_shared_name_without_clobbering(reported, kl_token):
    metrics = shared_metrics(dict(reported), None, Clock(), step_seconds=0.0)
    assert metrics.get("kl/token") == kl_token
    assert {k: metrics[k] for k in reported} == reported  # the loss's own names stay


# ---------------------------------------------------------------------- the loop
QUIET = {"progress": False}


def test_on_step_stops_early_after_recording_the_step():
    batches = iter(range(100, 110))
    seen = []

    def stop_after_three(index, metrics, rollouts):
        seen.append((index, metrics["reward/mean"], rollouts.batch_size))
        if index == 2:
            raise StopIteration

    source = Batches(batches)
    run = Run("T", steps=8, on_step=stop_after_three, progress=False)
    with run.driving(source):
        for step in run:
            batch = source.draw()
            with run.phase("rollout"):
                pass
            run.record({"reward/mean": float(batch), "index": step}, rows(1))
    assert seen == [(0, 100.0, 1), (1, 101.0, 1), (2, 102.0, 1)]
    assert [h["index"] for h in run.history] == [0, 1, 2]  # the stopping step is recorded
    assert next(batches) == 103  # nothing drawn after the stop
    for h in run.history:
        assert SHARED <= set(h)
        assert sum(h[k] for k in TIMES) <= h["step_seconds"]


def counted(batches, steps, body, **options):
    """A run over ``Batches(batches)`` whose steps are ``body(run, step, source)``; returns the
    run (its ``history``) and what the steps saw."""
    source = Batches(batches)
    blocks = options.pop("blocks", None)
    run = Run("T", steps=steps, blocks=blocks, **{**QUIET, **options})
    with run.driving(source):
        for step in run:
            body(run, step, source)
    return run


def test_the_run_ends_on_steps_and_when_the_data_runs_out():
    def body(run, step, source):
        run.record({"batch": source.draw()})

    batches = iter("abcdef")
    assert len(counted(batches, 2, body).history) == 2
    assert next(batches) == "c"  # no batch drawn beyond the steps
    ran_out = counted(iter("ab"), 5, body)
    assert [h["batch"] for h in ran_out.history] == ["a", "b"]  # the step that found none: gone


def test_code_after_the_for_does_not_run_when_the_data_ran_out():
    after = []
    source = Batches(iter("a"))
    run = Run("T", steps=3, **QUIET)
    with run.driving(source):
        for _ in run:
            run.record({"batch": source.draw()})
        after.append("inside")  # documented: skipped when the data ended the loop
    after.append("outside")
    assert after == ["outside"] and len(run.history) == 1


def test_continue_before_record_counts_the_step_with_the_runs_metrics():
    def body(run, step, source):
        batch = source.draw()
        if batch == "skip":
            return  # the loop's `continue`
        run.record({"batch": batch})

    run = counted(iter(["a", "skip", "b"]), 3, body)
    assert [h.get("batch") for h in run.history] == ["a", None, "b"]
    assert TIMES <= set(run.history[1]) and "step_seconds" in run.history[1]


@pytest.mark.parametrize(("work", "recorded"), [(True, 2), (False, 1)])
def test_break_records_the_step_only_if_it_entered_a_phase(work, recorded):
    source = Batches(iter("abc"))
    run = Run("T", steps=3, **QUIET)
    with run.driving(source):
        for step in run:
            if step == 1:
                if work:
                    with run.phase("update"):  # a break inside a phase closes it first
                        break
                break
            run.record({"batch": source.draw()})
    assert len(run.history) == recorded
    if work:
        assert run.history[1]["time/update"] >= 0.0 and "batch" not in run.history[1]


def test_misuse_is_refused_by_name():
    source = Batches(iter("ab"))
    run = Run("T", steps=2, **QUIET)
    with pytest.raises(RuntimeError, match=r"Run: run 'T' iterated outside its with-block"):
        iter(run)
    with pytest.raises(RuntimeError, match=r"Run.record: run 'T' recorded outside"):
        run.record({})
    with pytest.raises(RuntimeError, match=r"Run.phase: run 'T' timed 'reward' outside a step"):
        run.phase("reward")
    with run.driving(source):
        for step in run:
            run.record({"n": step})
            with pytest.raises(
                RuntimeError, match=rf"Run.record: run 'T' recorded step {step} twice"
            ):
                run.record({"n": step})
    assert [h["n"] for h in run.history] == [0, 1]  # the refused second record changed nothing
    with (
        pytest.raises(RuntimeError, match=r"Run.driving: run 'T' entered a second time"),
        run.driving(),
    ):
        pass
    again = Run("U", steps=1, **QUIET)
    refused = r"Batches: already driven by run .T.; a source belongs to one run"
    with pytest.raises(RuntimeError, match=refused), again.driving(source):
        pass
    with pytest.raises(TypeError, match=r"Run: staleness of run 'V' say how the source samples"):
        Run("V", steps=1, staleness=1)
    with pytest.raises(TypeError, match=r"Run: run 'V' got unknown option\(s\) chekpoint"):
        Run("V", steps=1, chekpoint="x")


def test_a_failing_step_saves_nothing_more_and_the_rerun_resumes(tmp_path):
    from builders import Counter

    def counting(fail_at):
        counter = Counter()

        def body(run, step, source):
            if step == fail_at:
                raise RuntimeError(f"step {step} fails")
            counter.n += source.draw()
            run.record({"n": float(counter.n)})

        saver = rb.checkpoint.Checkpointer(tmp_path / "ckpt", every=1)
        options = {"checkpoint": saver, "resume": "auto", "blocks": {"c": counter}}
        return counted(iter([1] * 5), 5, body, **options), saver

    with pytest.raises(RuntimeError, match="step 2 fails"):
        counting(fail_at=2)
    run, saver = counting(fail_at=None)  # the lock was released: the folder is free at once
    assert saver.latest() == 5
    # Steps 0 and 1 were checkpointed and resumed; the failing step saved nothing.
    assert [h["n"] for h in run.history] == [1.0, 2.0, 3.0, 4.0, 5.0]
