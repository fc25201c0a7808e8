"""Where a run's rollouts and their π_old come from: the one place that decides.

A recipe draws each step's rollouts from a `RolloutSource` and hands the update's weights back
to it (``source.sync``); `RunOptions` says how:

- **staleness 0** (default): the batch is sampled in the step, by the weights the update
  starts from. The engine idles during the update, the trainer during the sampling.
- **staleness 1**: the engine samples batch k + 1 in a background thread while the trainer
  updates on batch k (the "one-step-off" pipeline of verl's ``one_step_off_policy`` recipe and
  of AReaL / PipelineRL with a staleness bound of one)::

      step k:  take batch k (sampled during step k − 1, by the weights one update older)
               start sampling batch k + 1 with the engine's weights
               reward, advantages, update on batch k
               wait until batch k + 1 is sampled (the engine must be idle), sync the new weights

  The trainer and the engine must not share a module (the update would change the weights
  under the sampling). ``background=True`` runs the same thread at staleness 0: each batch
  starts only after the previous sync, which gives the synchronous run's numbers bit for bit
  (tests/run/test_source.py): the check that the machinery adds nothing but the overlap.

Every draw counts: DAPO's refill rounds draw again within a step. At staleness 1 a refill takes
the batch already being sampled (by the weights of this step's update, so staleness 0) and
starts the next one; every batch is drawn in the order the data gives it, as in a synchronous
run, and ``async/staleness`` is the mean over the step's rows.

**π_old** (``RunOptions.old_logprobs``; docs/run.md has the table): ``"auto"`` takes the
engine's log-probs exactly when it samples with the trainer's own module at the trainer's
temperature (:func:`samples_with_policy`) and the run is synchronous; ``"recompute"`` leaves
``old_logprobs`` empty, so the trainer takes them from the update's own forward (one optimizer
step) or scores them first; ``"rollout"`` always takes the engine's (the behaviour policy's:
one forward pass less, and the PPO ratio itself carries the off-policy correction). A recipe
that needs π_old before the update (PPO's KL penalty, distillation's and DPO's advantages)
asks :meth:`RolloutSource.with_old_logprobs`.

Threads: the sampling thread runs torch operations with the trainer's intra-op thread count
(``torch.set_num_threads`` is process-wide); on a CPU give each side its share of the cores.
A checkpoint holds the batch sampled ahead, so a resumed run trains on exactly that batch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from rlblocks import resharder as resharders
from rlblocks.interfaces import (
    Handle,
    PolicyTrainer,
    Resharder,
    RolloutEngine,
    Rollouts,
    SamplingParams,
)
from rlblocks.run.loop import Clock, OutOfData
from rlblocks.run.options import RunOptions
from rlblocks.run.state import Drawn

#: ``sample(batch) -> Rollouts``: how one prompt batch becomes rollouts.
Sample = Callable[[Any], Rollouts]


class Batch(NamedTuple):
    """A batch sampled (or being sampled), with the weight version that sampled it."""

    rollouts: Rollouts
    version: int
    seconds: float


def samples_with_policy(
    policy: PolicyTrainer, engine: RolloutEngine, sampling: SamplingParams
) -> bool:
    """True when ``engine`` samples with ``policy``'s own module at its temperature: an
    in-process engine whose ``model`` is the trainer's (the README's and the main job's setup;
    both attributes are part of the contracts in `rlblocks.interfaces`).

    Its rollout log-probs are then π_old up to the rounding of cached against uncached
    attention. A separate engine (its own copy, vLLM, a worker behind a placement's `Handle`)
    is never taken for it: a copy can be stale, and another kernel or dtype gives other
    numbers. Greedy sampling (T = 0) reports log-probs at T = 1.
    """
    if isinstance(engine, Handle) or isinstance(policy, Handle):
        return False  # other processes: nothing is fetched to find out
    temperature = sampling.temperature or 1.0
    shared = engine.model is not None and engine.model is policy.model
    return shared and temperature == policy.config.temperature


def check_replayed(rollouts: Rollouts, sampling: SamplingParams, engine: RolloutEngine) -> None:
    """Refuse a batch sampled with ``sampling.replay`` that came back without its sampler
    record (``Rollouts.sampler``), naming the engine (a placement's handle by what it holds):
    the trainer would score another distribution than the one sampled from, silently."""
    if sampling.replay and rollouts.sampler is None:
        name = repr(engine) if isinstance(engine, Handle) else type(engine).__name__
        raise ValueError(
            f"RolloutSource: SamplingParams(replay=True) asked of a {name}, whose rollouts came "
            "back without Rollouts.sampler (it cannot record its sampler); sample with an "
            "engine that records it (rb.rollout.HFEngine, VLLMEngine) or with replay=False"
        )


class Batches:
    """A plain stream of batches, one a step (SFT): the loop's `Source` without an engine."""

    def __init__(self, batches: Iterable[Any]) -> None:
        self.data = Drawn(batches)

    def draw(self) -> Any:
        """The next batch; `OutOfData` when the data ran out (the loop ends the run)."""
        batch = next(self.data, None)
        if batch is None:
            raise OutOfData
        return batch

    def blocks(self) -> dict[str, Any]:
        """The data position, for the checkpoint."""
        return {"data": self.data}

    def begin(self, index: int, *, last: bool) -> None:
        """Nothing to prepare."""

    def metrics(self) -> dict[str, float]:
        """No metrics of its own."""
        return {}

    def resync(self) -> None:
        """No engine to sync."""

    def close(self) -> None:
        """Nothing runs in the background."""


class RolloutSource:
    """Each step's rollouts, their π_old, and the sync of the new weights (module docstring).

    ``batches``: prompt batches (``.prompts``, ``.metadata``), drawn as the steps need them;
    ``group_size`` samples per prompt with ``sampling``, or ``sample(batch)`` when given (ReMax
    also samples greedy answers with the same weights). ``run.resharder`` moves the trainer's
    weights into the engine (None: a new `rlblocks.resharder.Resharder`). A `Stateful` checkpoint block (the batch sampled ahead); its
    data position and resharder are checkpointed beside it (`blocks`).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        policy: PolicyTrainer,
        batches: Iterable[Any],
        run: RunOptions | None = None,
        *,
        group_size: int,
        sampling: SamplingParams,
        sample: Sample | None = None,
    ) -> None:
        run = run or RunOptions()
        shares_weights = samples_with_policy(policy, engine, sampling)
        if run.staleness and shares_weights:
            raise ValueError(
                "RolloutSource: staleness=1 samples while the trainer updates, but this engine "
                "samples with the trainer's own module; build it with its own copy of the "
                "weights (rb.rollout.HFEngine.from_pretrained(...) or around "
                "copy.deepcopy(policy.model)): the resharder then syncs it after every update"
            )
        self.engine, self.policy, self.run = engine, policy, run
        self.resharder: Resharder = run.resharder or resharders.Resharder()
        self.data = Drawn(batches)
        self.group_size, self.sampling = group_size, sampling
        self._sample_fn = sample
        self.engine_logprobs_are_old = run.old_logprobs == "rollout" or (
            run.old_logprobs == "auto" and shares_weights and not run.staleness
        )
        """True when π_old is the engine's log-probs."""
        background = run.background or run.staleness > 0
        self._thread = ThreadPoolExecutor(1, "rlblocks-rollout") if background else None
        self._ahead: Future[Batch] | None = None
        self._version = 0  # weight syncs so far in this process
        self._last = False
        self._taken: list[tuple[int, int, float]] = []  # (rows, staleness, seconds) this step

    # ------------------------------------------------------------------ the loop's Source
    def blocks(self) -> dict[str, Any]:
        """The checkpoint's parts: data position, the batch sampled ahead, the resharder."""
        return {"data": self.data, "rollouts": self, "resharder": self.resharder}

    def begin(self, index: int, *, last: bool) -> None:
        """Step ``index`` starts; nothing is sampled ahead during the ``last`` one."""
        self._last = last
        self._taken = []

    def metrics(self) -> dict[str, float]:
        """With a background sampler: ``async/staleness`` (updates between the sampling weights
        and the trained ones, mean over the step's rows) and ``async/sample_seconds`` (the
        sampling's own time, of which ``time/rollout`` is what the step waited)."""
        if self._thread is None or not self._taken:
            return {}
        rows = sum(n for n, _, _ in self._taken)
        return {
            "async/staleness": sum(n * s for n, s, _ in self._taken) / max(rows, 1),
            "async/sample_seconds": sum(t for _, _, t in self._taken),
        }

    def resync(self) -> None:
        """Push the restored weights into the engine (it holds the initial ones)."""
        self.resharder.resync(self.policy, self.engine)

    def close(self) -> None:
        """Stop the sampling thread (after its current batch)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    # ------------------------------------------------------------------ what a recipe calls
    def draw(self, clock: Clock) -> Rollouts:
        """The next batch's rollouts, π_old attached as ``run.old_logprobs`` says; `OutOfData`
        when the batches ran out (the loop ends the run there). Timed as ``rollout``. At
        staleness 1 the batch after it starts sampling before this returns, unless this is the
        run's last step."""
        rollouts = self._draw(clock)
        if rollouts is None:
            raise OutOfData
        return rollouts

    def rounds(self, clock: Clock) -> Iterator[Rollouts]:
        """One `draw` a round until the batches run out (DAPO's dynamic sampling)."""
        while (rollouts := self._draw(clock)) is not None:
            yield rollouts

    def _draw(self, clock: Clock) -> Rollouts | None:
        with clock("rollout"):
            if self._ahead is None and not self._submit():
                return None
            batch = self._take()
        if self.run.staleness and not self._last:
            self._submit()
        self._taken.append((len(batch.rollouts), self._version - batch.version, batch.seconds))
        rollouts = batch.rollouts
        check_replayed(rollouts, self.sampling, self.engine)
        if self.engine_logprobs_are_old:
            rollouts = rollouts.replace(old_logprobs=rollouts.rollout_logprobs)
        return rollouts

    def with_old_logprobs(self, rollouts: Rollouts, clock: Clock) -> Rollouts:
        """``rollouts`` with π_old filled now, for a recipe that needs it before the update:
        as drawn, else scored by the trainer (timed as ``logprobs``)."""
        if rollouts.old_logprobs is not None:
            return rollouts
        with clock("logprobs"):
            return rollouts.replace(old_logprobs=self.policy.logprobs(rollouts))

    def sync(self, clock: Clock) -> dict[str, float]:
        """Wait until a batch being sampled ahead is complete (the engine must be idle; timed
        as ``rollout``), then move the trainer's new weights into the engine (``sync``)."""
        if self._ahead is not None:
            with clock("rollout"):
                self._ahead.exception()  # waits; an error is raised by the next draw
        with clock("sync"):
            metrics = self.resharder.sync(self.policy, self.engine)
        self._version += 1
        return metrics

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        """The batch sampled ahead (None without one), complete: it is part of the run. Its
        fields as a plain dict, so that a checkpoint holds it as data."""
        if self._ahead is None:
            return {"ahead": None}
        batch = self._ahead.result()
        fields = {f.name: getattr(batch.rollouts, f.name) for f in dataclasses.fields(Rollouts)}
        return {"ahead": fields, "seconds": batch.seconds, "staleness": 1}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved."""
        self._ahead = None
        if state["ahead"] is not None:
            if self._thread is None:
                raise ValueError(
                    "RolloutSource: the checkpoint holds a batch sampled one step ahead; resume "
                    "it with run=rb.run.RunOptions(staleness=1)"
                )
            done: Future[Batch] = Future()
            stale = int(state.get("staleness", 1))
            ahead = Rollouts(**state["ahead"])
            done.set_result(Batch(ahead, self._version - stale, float(state["seconds"])))
            self._ahead = done

    # ------------------------------------------------------------------ internals
    def _submit(self) -> bool:
        """Start sampling the next batch (in the thread, or now); False when there is none."""
        batch = next(self.data, None)
        if batch is None:
            return False
        if self._thread is None:
            done: Future[Batch] = Future()
            done.set_result(self._sample(batch, self._version))
            self._ahead = done
        else:
            self._ahead = self._thread.submit(self._sample, batch, self._version)
        return True

    def _sample(self, batch: Any, version: int) -> Batch:
        start = time.perf_counter()
        if self._sample_fn is not None:
            rollouts = self._sample_fn(batch)
        else:
            rollouts = self.engine.generate(
                batch.prompts,
                group_size=self.group_size,
                sampling=self.sampling,
                metadata=batch.metadata,
            )
        return Batch(rollouts, version, time.perf_counter() - start)

    def _take(self) -> Batch:
        ahead, self._ahead = self._ahead, None
        return ahead.result()  # an error in the thread is raised here, in the step


__all__ = [
    "Batch",
    "Batches",
    "RolloutSource",
    "Sample",
    "check_replayed",
    "samples_with_policy",
]
