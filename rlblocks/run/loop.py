"""The loop every recipe shares: progress bar, metrics, the ``time/*`` breakdown, ``on_step``,
early stop, checkpoints and the tracker. A recipe is its step function, read top to bottom;
`run_steps` runs it::

    def grpo(policy, engine, reward_fn, batches, *, steps, ..., run=None):
        source = RolloutSource(engine, policy, batches, run, group_size=..., sampling=...)

        def step(index: int, clock: Clock) -> Step | None:
            rollouts = source.draw(clock)  # π_old attached as run= says; OutOfData ends the run
            with clock("reward"):
                rewards, metrics = reward_fn(rollouts)
            ...
            with clock("update"):
                metrics |= policy.step(rollouts, advantages, loss_fn=loss_fn)
            metrics |= source.sync(clock)  # the new weights into the engine
            return Step(metrics, rollouts)

        return run_steps("GRPO", step, source, steps=steps, run=run, config=...)

The loop adds the metrics every recipe reports, so that they cannot drift apart:

- ``time/rollout``, ``time/reward``, ``time/logprobs``, ``time/update``, ``time/sync``: wall
  seconds of the step's lines in each phase (`Clock`), always all five (0.0 for a phase the
  step did not enter). The trainer scores π_old / π_ref inside ``policy.step``, where the
  recipe cannot time it: its ``logprob_seconds`` metric is moved from ``time/update`` to
  ``time/logprobs``. Wall time, not the blocks' own ``seconds``, so that on a Ray placement a
  remote call's round trip counts in the phase that made it; in one process the two agree.
- ``step_seconds``: the whole step. The ``time/*`` add up to a little less: the rest is the
  recipe's own arithmetic (advantages, the KL penalty) and bookkeeping.
- ``response_length``: mean response tokens of the rows the step returns (absent when it
  returns none: DAPO's skipped step).
- ``kl/token``, filled in as below.

The step function reports the rest: ``reward/mean`` from the reward function (every rlblocks
reward reports it), the trainer's metrics, the resharder's (``sync/…``), its own.

**The KL to the reference** has one set of names in every recipe. PPO measures it itself,
before the update (π_old against π_ref, with its KL estimator), and reports ``kl/token`` (mean
per-token estimate), ``kl/seq`` (mean over responses of Σ_t k_t) and ``kl/coef`` (the β used
this step). The GRPO family has a KL only when its loss has a KL term, and then the trainer
measures it during the update: ``kl_loss`` from `rlblocks.losses.kl_regularized`, ``kl`` from
`rlblocks.losses.kl_loss` composed into a loss by hand. When the step reported no ``kl/token``
of its own, the loop copies that value to ``kl/token``: same name, same quantity (with one
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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, ParamSpec, Protocol, TypeVar

from tqdm.auto import tqdm

from rlblocks.checkpoint import Checkpointer
from rlblocks.interfaces import Rollouts
from rlblocks.progress import Progress, set_current
from rlblocks.run.options import RunOptions
from rlblocks.run.preflight import check_steps
from rlblocks.run.resume import check_resumed, start_over
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

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase not in self.seconds:
            raise ValueError(f"Clock: unknown phase {phase!r}; the phases are {PHASES}")
        self._switch()
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


class Step(NamedTuple):
    """What a recipe's step function returns."""

    metrics: dict[str, Any]
    """The step's own metrics: the reward's, the trainer's, the resharder's, the recipe's."""
    rollouts: Rollouts | None
    """The rows the step trained on, handed to ``on_step``; None when there were none."""


#: ``step_fn(index, clock) -> Step``, or None when it found no data (the run ends there).
StepFn = Callable[[int, Clock], Step | None]


class OutOfData(Exception):
    """Raised by a source's ``draw`` when the batches ran out: the run ends there, and the
    step that found no data is not recorded."""


class Source(Protocol):
    """Where a run's steps get their data: what the loop asks of a source
    (`rlblocks.run.source.RolloutSource`, `rlblocks.run.source.Batches`)."""

    def blocks(self) -> dict[str, Any]:
        """The source's parts of a checkpoint, by name (data position, a batch sampled ahead)."""

    def begin(self, index: int, *, remaining: int) -> None:
        """Step ``index`` starts, ``remaining`` steps after it (nothing to sample ahead for
        steps that will not run)."""

    def metrics(self) -> dict[str, float]:
        """The source's own metrics of the step just run (``async/*``)."""

    def resync(self) -> None:
        """A run was resumed: push the restored weights where they are sampled from."""

    def close(self) -> None:
        """The run ended, however: stop any background work."""


def run_steps(
    name: str,
    step_fn: StepFn,
    source: Source,
    *,
    steps: int,
    run: RunOptions | None = None,
    config: Mapping[str, Any] | None = None,
    blocks: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run ``step_fn(index, clock)`` for ``index`` in ``range(steps)``; the step draws its data
    from ``source`` (`rlblocks.run.source.RolloutSource` for the RL recipes, `Batches` for a
    plain stream of batches).

    Each step gets a fresh `Clock`; its metrics are the step's plus the shared ones (module
    docstring). After each step the progress bar (``desc=name``, postfix the step's
    ``reward/mean``, else its ``loss``) moves, ``run.tracker.log(index, metrics, rollouts)``
    and ``run.on_step(index, metrics, rollouts)`` are called, and a checkpoint is saved when it
    is due. The run ends after ``steps`` steps, when ``step_fn`` returns None (the data ran
    out; that step is not recorded), or when ``on_step`` raises ``StopIteration`` (that step is
    recorded; the step's source raises `OutOfData`). Returns one metrics dict per recorded
    step, the resumed ones included. ``run`` None: ``RunOptions()``.

    Checkpoints: ``run.checkpoint`` (a `rlblocks.checkpoint.Checkpointer`, or a folder for one
    that saves every step) saves ``blocks`` (name -> block: the trainers, the KL controller,
    ...), the source (data position, a batch sampled ahead, the resharder), the random state,
    the history and ``config`` every ``checkpoint.every`` steps and when the run ends (after
    the last step, an early stop, or when the data ran out). The run holds the folder's lock
    (`rlblocks.checkpoint.lock`) from start to end: a second run there fails at once.
    ``run.resume``: False refuses a folder that already holds a checkpoint of a step, True
    resumes from its newest, ``"auto"`` resumes if there is one; a resumed source pushes the
    restored weights into its engine (``source.resync()``). What a resumed run may change is in
    `rlblocks.run.resume`: honoured from the first resumed step on, or refused before it. A run
    that starts at step 0 in a folder where a run never checkpointed a step starts it over
    (`rlblocks.run.resume.start_over`). ``run.tracker``: started with ``config`` (and the step
    resumed from; 0 for a run started over, so that the old run's records go). A run that starts
    at step 0 saves the checkpoint of step 0 (the initial weights) before its first step.
    """
    check_steps(name, steps)  # before any folder is made or anything runs
    run = run or RunOptions()
    saver = (
        Checkpointer(run.checkpoint) if isinstance(run.checkpoint, str | Path) else run.checkpoint
    )
    watchdog = run.watchdog
    if watchdog is not None:  # Ray handles among the blocks report their workers' stacks too
        found = {**(blocks or {}), **getattr(source, "workers", dict)()}
        for key, block in found.items():
            if callable(getattr(block, "stacks", None)):
                watchdog.workers.setdefault(key, block)
    state = {**(blocks or {}), **source.blocks()}
    config = {**dict(config or {}), "run": run.describe()}
    start, history, rerun = 0, [], False
    acquired = False
    try:
        if saver is not None:
            saver.lock.acquire()  # one run per folder: a second one fails here, at once
            acquired = True
        resumed = saver is not None and saver.resume_step(run.resume) is not None
        if resumed:
            assert saver is not None  # resumed says so
            restored = saver.load(state)
            start, history = restored.step, list(restored.history)
            check_resumed(restored.config, config, done=start, steps=steps, where=saver.root)
            source.resync()
        elif saver is not None:  # from step 0: what a run that never checkpointed left goes
            rerun = start_over(saver)
            saver.save(0, state, history=history, config=config)  # the initial weights
        if run.tracker is not None:
            # a rerun drops the records of that run, as a resume from step 0 would
            run.tracker.start(config, resume_step=start if resumed or rerun else None)
        bar = tqdm(total=steps, initial=start, desc=name, disable=not run.progress, unit="step")
        with bar:
            for index in range(start, steps):
                set_current(Progress(index, steps, _epochs_drawn(source)))
                source.begin(index, remaining=steps - index - 1)
                if watchdog is not None:
                    watchdog.clear_notes()
                clock = Clock(watchdog=watchdog, step=index)
                begin = time.perf_counter()
                try:
                    out = step_fn(index, clock)
                except OutOfData:
                    out = None
                if out is None:
                    break
                metrics = shared_metrics(out, clock, step_seconds=time.perf_counter() - begin)
                metrics |= source.metrics()  # async/* of a background sampler
                history.append(metrics)
                bar.update()
                _postfix(bar, metrics)
                stop = _report(index, metrics, out.rollouts, run)
                if saver is not None and saver.due(len(history)):
                    with _watched(watchdog, "checkpoint", index):
                        saver.save(len(history), state, history=history, config=config)
                if stop:
                    break
        if saver is not None and len(history) > max(start, saver.latest() or 0):
            saver.save(len(history), state, history=history, config=config)  # however it ended
    finally:
        set_current(None)
        source.close()
        if watchdog is not None:
            watchdog.close()
        if acquired:
            assert saver is not None  # acquired says so
            saver.lock.release()
    return history


def _epochs_drawn(source: Any) -> float | None:
    """Epochs of the prompt data drawn so far, fractional, when the batches can say
    (`rlblocks.data.PromptBatches.epochs_drawn`); else None."""
    batches = getattr(getattr(source, "data", None), "source", None)
    drawn = getattr(batches, "epochs_drawn", None)
    return float(drawn) if isinstance(drawn, int | float) else None


@contextmanager
def _watched(watchdog: Watchdog | None, phase: str, step: int) -> Iterator[None]:
    """``phase`` under the watchdog's deadline (a phase outside the step's `Clock`)."""
    if watchdog is None:
        yield
        return
    start = time.perf_counter()
    watchdog.enter(phase, step)
    try:
        yield
    finally:
        watchdog.leave(phase, time.perf_counter() - start)


def _postfix(bar: tqdm, metrics: dict[str, Any]) -> None:
    """The step's reward on the progress bar, or its loss when it has none (SFT, distillation
    without a task reward: the loss is what moves)."""
    if "reward/mean" in metrics or "loss" not in metrics:
        bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
    else:
        bar.set_postfix(loss=f"{metrics['loss']:.3f}")


def _report(
    index: int, metrics: dict[str, Any], rollouts: Rollouts | None, run: RunOptions
) -> bool:
    """Hand the step to the tracker and ``on_step``; True when ``on_step`` asks to stop."""
    if run.tracker is not None:
        run.tracker.log(index, metrics, rollouts)
    if run.on_step is not None:
        try:
            run.on_step(index, metrics, rollouts)
        except StopIteration:
            return True
    return False


def shared_metrics(out: Step, clock: Clock, *, step_seconds: float) -> dict[str, Any]:
    """The step's metrics plus ``response_length``, ``step_seconds``, ``time/*`` and
    ``kl/token`` (module docstring)."""
    metrics = dict(out.metrics)
    if out.rollouts is not None:
        metrics["response_length"] = out.rollouts.response_lengths.float().mean().item()
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


__all__ = [
    "KL_LOSS_METRICS",
    "PHASES",
    "Clock",
    "OutOfData",
    "Source",
    "Step",
    "StepFn",
    "run_steps",
    "shared_metrics",
]
