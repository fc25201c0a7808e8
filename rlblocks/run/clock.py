"""The step's clock and the metrics every step reports, whoever drives the loop
(`rlblocks.run.Run`).

A run adds the metrics every step reports (`Run.record`), so that they cannot drift apart:

- ``time/rollout``, ``time/reward``, ``time/logprobs``, ``time/update``, ``time/sync``: wall
  seconds of the step's lines in each phase (`Clock`), always all five (0.0 for a phase the
  step did not enter). The trainer scores π_old / π_ref inside ``policy.step``, where the
  recipe cannot time it: its ``logprob_seconds`` metric is moved from ``time/update`` to
  ``time/logprobs``. Wall time, not the blocks' own ``seconds``, so that on a Ray placement a
  remote call's round trip counts in the phase that made it; in one process the two agree.
- ``step_seconds``: the whole step. The ``time/*`` add up to a little less: the rest is the
  recipe's own arithmetic (advantages, the KL penalty) and bookkeeping.
- ``response_length``: mean response tokens of the rows the step records (absent when it
  records none: DAPO's skipped step).
- ``kl/token``, filled in as below.

The loop's body reports the rest, in ``run.record``: ``reward/mean`` from the reward function (every rlblocks
reward reports it), the trainer's metrics, the resharder's (``sync/…``), its own.

**The KL to the reference** has one set of names in every recipe. PPO measures it itself,
before the update (π_old against π_ref, with its KL estimator), and reports ``kl/token`` (mean
per-token estimate), ``kl/seq`` (mean over responses of Σ_t k_t) and ``kl/coef`` (the β used
this step). The GRPO family has a KL only when its loss has a KL term, and then the trainer
measures it during the update: ``kl_loss`` from `rlblocks.losses.kl_regularized`, ``kl`` from
`rlblocks.losses.kl_loss` composed into a loss by hand. When the step reported no ``kl/token``
of its own, the run copies that value to ``kl/token``: same name, same quantity (with one
mini-batch and one epoch the update's first forward is π_old, so the two measurements are
equal; with more they differ by how far the update moved). The loss's own name stays beside it,
and a ``kl/token`` the step measured is never overwritten (PPO with ``kl_in_reward=False``
reports both its ``kl/token`` and the loss's ``kl_loss``). ``kl/seq`` and ``kl/coef`` are
PPO's only: they come from its KL penalty and KL controller; in the GRPO family β sits inside
the loss.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

from rlblocks.interfaces import Rollouts
from rlblocks.run.watchdog import Watchdog

P = ParamSpec("P")
R = TypeVar("R")

#: The phases of a step, reported as ``time/<phase>``.
PHASES = ("rollout", "reward", "logprobs", "update", "sync")

#: Where a KL loss term reports the KL to the reference: `kl_regularized`'s, then `kl_loss`'s.
KL_LOSS_METRICS = ("kl_loss", "kl")


class Clock:
    """Wall seconds per phase of one step: ``with clock("rollout"): ...``.

    A phase entered inside another pauses the outer one, so every second counts once: DAPO's
    generation rounds run under ``clock("rollout")`` and score with a reward wrapped by
    ``clock.timed("reward", reward_fn)``. Entering a phase again adds to it. ``timer`` is the
    time source (``time.perf_counter``; a test passes a fake).
    """

    def __init__(
        self,
        timer: Callable[[], float] = time.perf_counter,
        *,
        watchdog: Watchdog | None = None,
        step: int = 0,
    ) -> None:
        self.timer = timer
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.watchdog, self.step = watchdog, step
        self._open: list[str] = []
        self._since = 0.0
        self.entered = False
        """True once any phase was entered (the step did some work)."""

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase not in self.seconds:
            raise ValueError(f"Clock: unknown phase {phase!r}; the phases are {PHASES}")
        self._switch()
        self.entered = True
        self._open.append(phase)
        start = self.timer()
        if self.watchdog is not None:
            self.watchdog.enter(phase, self.step)
        try:
            yield
        finally:
            self._switch()
            self._open.pop()
            if self.watchdog is not None:
                self.watchdog.leave(phase, self.timer() - start)
                if self._open:  # the outer phase goes on, with a deadline of its own again
                    self.watchdog.enter(self._open[-1], self.step)

    def note(self, **info: Any) -> None:
        """What the step is working on (``rows=``, ``prompts=``), for the watchdog's report
        (`rlblocks.run.watchdog`); nothing without a watchdog."""
        if self.watchdog is not None:
            self.watchdog.note(**info)

    def timed(self, phase: str, fn: Callable[P, R]) -> Callable[P, R]:
        """``fn`` with every call timed as ``phase`` (for calls made inside another block)."""

        def timed_fn(*args: P.args, **kwargs: P.kwargs) -> R:
            with self(phase):
                return fn(*args, **kwargs)

        return timed_fn

    def _switch(self) -> None:
        # Charge the time since the last switch to the innermost open phase.
        now = self.timer()
        if self._open:
            self.seconds[self._open[-1]] += now - self._since
        self._since = now


def shared_metrics(
    metrics: dict[str, Any], rollouts: Rollouts | None, clock: Clock, *, step_seconds: float
) -> dict[str, Any]:
    """The step's metrics plus ``response_length``, ``step_seconds``, ``time/*`` and
    ``kl/token`` (module docstring)."""
    metrics = dict(metrics)
    if rollouts is not None:
        metrics["response_length"] = rollouts.response_lengths.float().mean().item()
    metrics["step_seconds"] = step_seconds
    seconds = dict(clock.seconds)
    scoring = float(metrics.get("logprob_seconds", 0.0))  # inside policy.step, timed as update
    scoring = min(scoring, seconds["update"]) if math.isfinite(scoring) else 0.0
    seconds["logprobs"] += scoring
    seconds["update"] -= scoring
    metrics |= {f"time/{phase}": s for phase, s in seconds.items()}
    if "kl/token" not in metrics:
        for key in KL_LOSS_METRICS:
            if key in metrics:
                metrics["kl/token"] = float(metrics[key])
                break
    return metrics


__all__ = ["KL_LOSS_METRICS", "PHASES", "Clock", "shared_metrics"]
