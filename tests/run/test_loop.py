"""The loop every recipe shares (rlblocks/run/loop.py): the clock, early stop, the metrics it
adds, and how a run ends."""

from __future__ import annotations

import pytest

import rlblocks as rb
from rlblocks.run import Batches, RunOptions
from rlblocks.run.loop import PHASES, Clock, Step, run_steps, shared_metrics

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
    out = Step({"reward/mean": 0.25, "seconds": 2.9, "logprob_seconds": 1.0}, rows(2, 4))
    metrics = shared_metrics(out, clock, step_seconds=9.0)
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
    empty = shared_metrics(Step({}, None), Clock(FakeTimer()), step_seconds=1.0)
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
    metrics = shared_metrics(Step(dict(reported), None), Clock(), step_seconds=0.0)
    assert metrics.get("kl/token") == kl_token
    assert {k: metrics[k] for k in reported} == reported  # the loss's own names stay


# ---------------------------------------------------------------------- the loop
def _from(batches, step):
    """``step(index, batch, clock)`` as the loop's step function over a plain `Batches`."""
    source = Batches(batches)

    def step_fn(index, clock):
        batch = source.draw()
        return None if batch is None else step(index, batch, clock)

    return step_fn, source


def test_run_steps_calls_on_step_and_stops_early():
    batches = iter(range(100, 110))
    seen = []

    def step(index, batch, clock):
        with clock("rollout"):
            pass
        return Step({"reward/mean": float(batch), "index": index}, rows(1))

    def stop_after_three(index, metrics, rollouts):
        seen.append((index, metrics["reward/mean"], rollouts.batch_size))
        if index == 2:
            raise StopIteration

    run = RunOptions(on_step=stop_after_three, progress=False)
    history = run_steps("T", *_from(batches, step), steps=8, run=run)
    assert seen == [(0, 100.0, 1), (1, 101.0, 1), (2, 102.0, 1)]
    assert [h["index"] for h in history] == [0, 1, 2]  # the stopping step is recorded
    assert next(batches) == 103  # nothing drawn after the stop
    for h in history:
        assert SHARED <= set(h)
        assert sum(h[k] for k in TIMES) <= h["step_seconds"]


def test_run_steps_ends_on_steps_on_data_and_on_a_step_with_no_data():
    def step(index, batch, clock):
        return None if batch == "end" else Step({}, rows(1))

    quiet = RunOptions(progress=False)
    batches = iter("abcdef")
    assert len(run_steps("T", *_from(batches, step), steps=2, run=quiet)) == 2
    assert next(batches) == "c"  # zip(range(steps), batches): no batch drawn beyond steps
    assert len(run_steps("T", *_from(iter("ab"), step), steps=5, run=quiet)) == 2  # ran out
    # A step that finds no data ends the run and is not recorded (DAPO's batches ran out).
    seen = []
    run = RunOptions(on_step=lambda *a: seen.append(a[0]))
    history = run_steps("T", *_from(iter(["a", "end", "b"]), step), steps=5, run=run)
    assert len(history) == 1 and seen == [0]
