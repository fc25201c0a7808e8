"""`Run`: the run floor under a loop the caller writes. Every recipe is this loop, and so is
the README's cell::

    run = rb.run.Run("grpo", steps=100, checkpoint="runs/grpo", resume="auto",
                     blocks={"policy": policy})
    source = rb.run.RolloutSource(engine, policy, batches, group_size=8, sampling=sampling)
    with run.driving(source):          # lock, resume or the step-0 checkpoint, tracker
        for step in run:               # progress bar, watchdog, the step's clock
            rollouts = source.draw()   # timed as "rollout"; π_old as the source says
            with run.phase("reward"):
                rewards, metrics = reward_fn(rollouts)
            ...
            with run.phase("update"):
                metrics |= policy.step(rollouts, advantages, loss_fn=loss_fn)
            metrics |= source.sync()   # timed as "sync"
            run.record(metrics, rollouts)   # metrics, tracker, on_step, checkpoint when due

**Entering** ``run.driving(source)`` takes the checkpoint folder's lock (a second run there
fails at once), then resumes (the blocks, the source's data position and batches sampled
ahead, the random state, the history; ``resume``: False refuses a folder holding a checkpoint,
True resumes from its newest, ``"auto"`` resumes if there is one; what a resumed run may change
is in `rlblocks.run.resume`) or, from step 0, saves the checkpoint of step 0 (the initial
weights); then the tracker starts with the run's config. The source is attached to the run: its
draws and syncs are timed on the step's clock, and it is closed when the block is left.

**Each step** ``for step in run`` hands out the step's index (from the resumed step on) with a
fresh clock (`rlblocks.run.clock.Clock`: ``run.phase(name)`` times a phase, nested phases count
each second once), the watchdog's deadlines, ``rlblocks.base.progress.current``, and the source
told how many steps remain (nothing is sampled ahead for a step that will not run).
``run.record(metrics, rollouts)`` adds the metrics every step reports (`rlblocks.run.clock`)
and the source's (``async/*``), and ``signal/*`` with a warning after steps that carry no
learning signal (`rlblocks.run.signal`), appends them to ``run.history``, moves the progress bar,
calls the tracker and ``on_step`` and saves a checkpoint when one is due; it returns the
step's full metrics.

**Control flow is the loop's own:**

- ``break`` ends the run. A step left by ``break`` before ``record`` is recorded with the run's
  metrics alone (``time/*``, ``step_seconds``) when it entered a phase (it drew data, scored,
  updated or synced: the weights may have moved, and the checkpoint must count that step), and
  dropped when it entered none (it did nothing). A ``break`` inside ``with run.phase(...)``
  closes the phase first: the step entered it, so it is recorded.
- ``continue`` before ``record`` records the step with the run's metrics alone: a step handed
  out is always counted, so the step count, the checkpoints and the weights agree (DAPO's
  skipped step records its ``sampling/*`` metrics and continues).
- The data running out ends the run: ``source.draw()`` raises `OutOfData`, which leaves the
  ``for`` and is taken by ``driving``; the step that found no data is not recorded. Code after
  the ``for`` inside the ``with`` does not run then: put it after the ``with``.
- ``on_step`` raising ``StopIteration`` (a recipe's caller asking to stop) ends the run after
  that step, which is recorded.

**Leaving** the ``with`` however it ends closes the source, stops the watchdog and releases the
lock. When the loop ended (all steps, ``break``, the data ran out, ``on_step``), the final
checkpoint is saved if the last step was not checkpointed. When an exception left it (a
failing block, ``KeyboardInterrupt``), nothing more is saved: the step in flight may have
moved the weights half-way, and the newest checkpoint (every step by default, for a folder)
stays the one to resume from; a killed run loses no step it checkpointed.

Misuse is refused by name: a `Run` entered twice (build a new one: it resumes from the folder),
``for step in run`` or ``record`` outside ``driving``, ``record`` twice for one step, a source
attached to another run or closed by one, a phase outside a step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, Protocol, TypeVar

from tqdm.auto import tqdm

from rlblocks.base.progress import Progress, set_current
from rlblocks.checkpoint import Checkpointer
from rlblocks.interfaces import Rollouts
from rlblocks.run.clock import Clock, shared_metrics
from rlblocks.run.options import LOOP_FIELDS, SOURCE_FIELDS, RunOptions
from rlblocks.run.preflight import check_steps
from rlblocks.run.resume import check_resumed, start_over
from rlblocks.run.signal import SignalWatch
from rlblocks.run.watchdog import Watchdog

P = ParamSpec("P")
R = TypeVar("R")


class OutOfData(Exception):
    """Raised by a source's ``draw`` when the batches ran out: ``Run.driving`` takes it and
    ends the run there; the step that found no data is not recorded."""


class Source(Protocol):
    """Where a run's steps get their data: what a `Run` asks of a source
    (`rlblocks.run.source.RolloutSource`, `rlblocks.run.batches.Batches`; any object with these
    methods)."""

    def attach(self, run: Run) -> None:
        """The run that drives the source from now on (its clock times the draws); refuse a
        second run."""

    def describe(self) -> dict[str, Any]:
        """What of the source changes the numbers a run computes (staleness, π_old), for the
        run's config."""

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


class NoSource:
    """The source of a run whose loop gets its data itself: nothing to checkpoint or sync."""

    def attach(self, run: Run) -> None:
        """Nothing to time."""

    def describe(self) -> dict[str, Any]:
        """Nothing that changes the numbers."""
        return {}

    def blocks(self) -> dict[str, Any]:
        """No data position."""
        return {}

    def begin(self, index: int, *, remaining: int) -> None:
        """Nothing to prepare."""

    def metrics(self) -> dict[str, float]:
        """No metrics of its own."""
        return {}

    def resync(self) -> None:
        """No engine to sync."""

    def close(self) -> None:
        """Nothing runs in the background."""


class Run:
    """The run floor under the caller's ``for`` loop (module docstring).

    ``name``: the run's name (the progress bar's, and the ``recipe`` of its config: a resumed
    run of another name is refused). ``steps``: how many steps the run has, resumed ones
    included. ``blocks``: name -> checkpointed block (the trainers, a KL controller: anything
    with ``state_dict``/``load_state_dict``). ``config``: what the run computes with, as JSON
    (`rlblocks.run.run_config`), logged once and checked on resume; the source's sampling
    policy is added as ``config["run"]``. The loop's options as keywords (``checkpoint``,
    ``resume``, ``tracker``, ``watchdog``, ``progress``, ``on_step``: `RunOptions`' fields),
    or ``options=`` a whole `RunOptions` (a recipe's ``run=``; its sampling fields are the
    source's, handed to it by the recipe).
    """

    def __init__(
        self,
        name: str,
        *,
        steps: int,
        blocks: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        options: RunOptions | None = None,
        **loop: Any,
    ) -> None:
        check_steps(name, steps)  # before any folder is made or anything runs
        sampling = sorted(set(loop) & SOURCE_FIELDS)
        if sampling:
            raise TypeError(
                f"Run: {', '.join(sampling)} of run {name!r} say how the source samples, not how "
                f"the loop runs; pass {sampling[0]}= to rb.run.RolloutSource(...)"
            )
        unknown = sorted(set(loop) - LOOP_FIELDS)
        if unknown:
            raise TypeError(
                f"Run: run {name!r} got unknown option(s) {', '.join(unknown)}; the loop's options are "
                f"{', '.join(sorted(LOOP_FIELDS))}"
            )
        if options is not None and loop:
            raise TypeError(
                f"Run: run {name!r} got both; pass options=RunOptions(...) or the options as keywords "
                f"({', '.join(sorted(loop))}), not both"
            )
        self.name, self.steps = name, steps
        self.options = options if options is not None else RunOptions(**loop)
        self.blocks = dict(blocks or {})
        self.config: dict[str, Any] = {"recipe": name, **dict(config or {})}
        self.history: list[dict[str, Any]] = []
        """One metrics dict per recorded step, the resumed ones included."""
        self.clock: Clock | None = None
        """The clock of the step in progress (None between steps)."""
        self.step: int | None = None
        """The index of the step in progress (None between steps)."""
        self._entered = self._driving = self._iterated = self._stop = False
        self._recorded = True  # no step is open
        self._source: Source = NoSource()
        self._signal = SignalWatch(f"Run {name!r}")
        self._saver: Checkpointer | None = None
        self._bar: tqdm | None = None
        self._begin = 0.0
        self._start = 0

    # ------------------------------------------------------------------ the with-block
    @contextmanager
    def driving(self, source: Source | None = None) -> Iterator[Run]:
        """Drive the run over ``source`` (None: the loop gets its data itself): lock, resume or
        save the step-0 checkpoint, start the tracker; on leaving, the final checkpoint, the
        source closed, the lock released (module docstring)."""
        if self._entered:
            raise RuntimeError(
                f"Run.driving: run {self.name!r} entered a second time; a Run drives one pass of the loop: "
                "build a new Run with the same checkpoint folder and resume='auto' to go on"
            )
        self._entered = True
        self._source = source if source is not None else NoSource()
        self._source.attach(self)
        saver = self.options.checkpoint
        self._saver = Checkpointer(saver) if isinstance(saver, str | Path) else saver
        watchdog = self.options.watchdog
        if watchdog is not None:  # Ray handles among the blocks report their workers' stacks
            found = {**self.blocks, **getattr(self._source, "workers", dict)()}
            for key, block in found.items():
                if callable(getattr(block, "stacks", None)):
                    watchdog.workers.setdefault(key, block)
        self.config["run"] = self._source.describe()
        acquired = ended = False
        try:
            if self._saver is not None:
                self._saver.lock.acquire()  # one run per folder: a second one fails here
                acquired = True
            self._resume_or_start()
            self._bar = tqdm(
                total=self.steps,
                initial=self._start,
                desc=self.name,
                disable=not self.options.progress,
                unit="step",
            )
            self._driving = True
            try:
                yield self
            except OutOfData:  # the data ran out: the step that found none is not recorded
                self._close_step(record=False)
            else:
                self._close_step(record=self.clock is not None and self.clock.entered)
            ended = True
            self._driving = False
            self._save_final()
        finally:
            self._driving = False
            if not ended:
                self._close_step(record=False)
            set_current(None)
            if self._bar is not None:
                self._bar.close()
            self._source.close()
            if watchdog is not None:
                watchdog.close()
            if acquired:
                assert self._saver is not None  # acquired says so
                self._saver.lock.release()

    def _resume_or_start(self) -> None:
        """Restore the newest checkpoint, or save step 0's; start the tracker."""
        saver, state, rerun = self._saver, self._state(), False
        resumed = saver is not None and saver.resume_step(self.options.resume) is not None
        if resumed:
            assert saver is not None  # resumed says so
            restored = saver.load(state)
            self._start, self.history = restored.step, list(restored.history)
            check_resumed(
                restored.config, self.config, done=self._start, steps=self.steps, where=saver.root
            )
            self._source.resync()
        elif saver is not None:  # from step 0: what a run that never checkpointed left goes
            rerun = start_over(saver)
            saver.save(0, state, history=self.history, config=self.config)  # initial weights
        tracker = self.options.tracker
        if tracker is not None:  # a rerun drops that run's records, as a resume from 0 would
            tracker.start(self.config, resume_step=self._start if resumed or rerun else None)

    @property
    def start(self) -> int:
        """The step this pass of the loop started from: 0, or the step resumed after."""
        return self._start

    def _state(self) -> dict[str, Any]:
        return {**self.blocks, **self._source.blocks()}

    def _save_final(self) -> None:
        saver = self._saver
        if saver is not None and len(self.history) > max(self._start, saver.latest() or 0):
            saver.save(len(self.history), self._state(), history=self.history, config=self.config)

    # ------------------------------------------------------------------ the for-loop
    def __iter__(self) -> Iterator[int]:
        if not self._driving:
            raise RuntimeError(
                f"Run: run {self.name!r} iterated outside its with-block; put `for step in run:` "
                "inside `with run.driving(source):` (it takes the lock and resumes)"
            )
        if self._iterated:
            raise RuntimeError(
                f"Run: run {self.name!r} iterated a second time; one `for step in run:` per "
                "`with run.driving(...)`"
            )
        self._iterated = True
        return self._steps()

    def _steps(self) -> Iterator[int]:
        for index in range(len(self.history), self.steps):
            self._open_step(index)
            yield index
            self._close_step(record=True)  # the body went on: record or continue
            if self._stop:
                return

    def _open_step(self, index: int) -> None:
        source, watchdog = self._source, self.options.watchdog
        set_current(Progress(index, self.steps, _epochs_drawn(source)))
        source.begin(index, remaining=self.steps - index - 1)
        if watchdog is not None:
            watchdog.clear_notes()
        self.step, self.clock = index, Clock(watchdog=watchdog, step=index)
        self._recorded, self._begin = False, time.perf_counter()

    def _close_step(self, *, record: bool) -> None:
        """The step ends: recorded with the run's metrics alone when ``record`` and the body
        did not record it, else dropped."""
        if not self._recorded and record:
            self.record({})
        self.step, self.clock, self._recorded = None, None, True

    # ------------------------------------------------------------------ inside a step
    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """``with run.phase("reward"): ...``: the lines inside count as ``time/reward``
        (phases: `rlblocks.run.clock.PHASES`); nested phases count each second once."""
        if self.clock is None:
            raise RuntimeError(
                f"Run.phase: run {self.name!r} timed {name!r} outside a step; time phases inside "
                "`for step in run:`"
            )
        return self.clock(name)

    def timed(self, phase: str, fn: Callable[P, R]) -> Callable[P, R]:
        """``fn`` with every call timed as ``phase`` of the step in progress (for calls made
        inside another block: DAPO's scoring inside its sampling rounds)."""

        def timed_fn(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.phase(phase):
                return fn(*args, **kwargs)

        return timed_fn

    def note(self, **info: Any) -> None:
        """What the step is working on, for the watchdog's report (`Clock.note`)."""
        if self.clock is not None:
            self.clock.note(**info)

    def record(
        self, metrics: Mapping[str, Any], rollouts: Rollouts | None = None
    ) -> dict[str, Any]:
        """The step's metrics (the reward's, the trainer's, the resharder's, the loop's own)
        and the rows it trained on (None: none, DAPO's skipped step): the run's metrics are
        added, the tracker and ``on_step`` get them, a checkpoint is saved when due (module
        docstring). Returns the step's full metrics. Once per step."""
        if self.clock is None or self.step is None:
            where = "after its step" if self._driving else "outside `with run.driving():`"
            raise RuntimeError(
                f"Run.record: run {self.name!r} recorded {where}; record each step once, inside "
                "`for step in run:` (merge metrics first: metrics | more)"
            )
        if self._recorded:
            raise RuntimeError(
                f"Run.record: run {self.name!r} recorded step {self.step} twice; record each step "
                "once (merge metrics first: metrics | more)"
            )
        self._recorded = True
        index, clock = self.step, self.clock
        elapsed = time.perf_counter() - self._begin
        step_metrics = shared_metrics(dict(metrics), rollouts, clock, step_seconds=elapsed)
        step_metrics |= self._source.metrics()  # async/* of a background sampler
        if rollouts is not None:  # signal/*: warns after steps without a learning signal
            step_metrics |= self._signal.observe(index, rollouts, _budget(self._source))
        self.history.append(step_metrics)
        if self._bar is not None:
            self._bar.update()
            _postfix(self._bar, step_metrics)
        self._stop = _report(index, step_metrics, rollouts, self.options)
        saver = self._saver
        if saver is not None and saver.due(len(self.history)):
            with _watched(self.options.watchdog, "checkpoint", index):
                saver.save(
                    len(self.history), self._state(), history=self.history, config=self.config
                )
        return step_metrics


def _budget(source: Any) -> int | None:
    """The source's ``max_new_tokens`` (a `RolloutSource`'s sampling), else None."""
    budget = getattr(getattr(source, "sampling", None), "max_new_tokens", None)
    return budget if isinstance(budget, int) else None


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
    index: int, metrics: dict[str, Any], rollouts: Rollouts | None, options: RunOptions
) -> bool:
    """Hand the step to the tracker and ``on_step``; True when ``on_step`` asks to stop."""
    if options.tracker is not None:
        options.tracker.log(index, metrics, rollouts)
    if options.on_step is not None:
        try:
            options.on_step(index, metrics, rollouts)
        except StopIteration:
            return True
    return False


__all__ = ["NoSource", "OutOfData", "Run", "Source"]
