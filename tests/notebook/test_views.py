"""The two views' building blocks: the status line and its ETA arithmetic."""

import io
import math

import pytest

from rlblocks.notebook.views import Status, TerminalView, clock_time


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.4, "0:00:00"), (9, "0:00:09"), (3725.4, "1:02:05"), (math.nan, "?"), (math.inf, "?")],
)
def test_clock_time(seconds, text):
    # 3725.4 s = 1 h (3600) + 2 min (120) + 5.4 s, rounded to 5 s.
    assert clock_time(seconds) == text


def test_eta_is_mean_step_time_times_steps_left():
    # 3 of 10 steps done at 2.5 s each: 7 left × 2.5 s = 17.5 s -> "0:00:18".
    status = Status(step=2, count=3, total=10, seconds_per_step=2.5, elapsed=7.5)
    assert status.eta == 17.5
    assert status.describe() == "3/10 · 2.50 s/step · ETA 0:00:18"


def test_no_eta_without_a_total_and_none_past_it():
    assert Status(4, 5, None, 1.0, 5.0).eta is None
    assert Status(4, 5, None, 1.0, 5.0).describe() == "5 · 1.00 s/step"
    assert Status(11, 12, 10, 1.0, 12.0).eta == 0.0  # more steps than announced: no negative ETA


def test_terminal_view_writes_only_the_curves_present():
    out = io.StringIO()
    view = TerminalView(total=2, curves=(("reward/mean", "reward"), ("kl", "KL")), file=out)
    history = [{"step": 5, "reward/mean": 0.125, "loss": 3.0}]
    view.update(Status(5, 1, 2, 2.0, 2.0), history, [], True)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("step"))
    # Not kl (absent), not loss (not a curve); 1 step left at 2 s -> ETA 2 s.
    assert line == "step 5  reward/mean=0.125  [1/2 · 2.00 s/step · ETA 0:00:02]"
    assert view.bar.n == 1
    view.close(Status(5, 1, 2, 2.0, 2.0), history, [])
    assert "done: 1 step in 0:00:02 (2.00 s/step)" in out.getvalue()
