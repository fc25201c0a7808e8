"""Where a run's rollouts and their π_old come from: the one place that decides.

A loop draws each step's rollouts from a `RolloutSource` (``source.draw()``) and hands the
update's weights back to it (``source.sync()``); its keywords (the same fields of a recipe's
`RunOptions`) say how:

- **staleness 0** (default): the batch is sampled in the step, by the weights the update
  starts from. The engine idles during the update, the trainer during the sampling.
- **staleness k ≥ 1**: the engine samples ahead, in a background thread, while the trainer
  updates: the batch trained at step t was sampled by the weights of step t − k, exactly (the
  "one-step-off" pipeline of verl's ``one_step_off_policy`` recipe at k = 1; AReaL and
  PipelineRL bound the staleness the same way, though there the engine runs ahead as far as
  the bound lets it, and the staleness of a batch depends on timing)::

      step t:  take batch t (sampled during step t − k, by the weights k updates older)
               start sampling batch t + k with the engine's weights (those of step t)
               reward, advantages, update on batch t
               wait until every batch started is sampled (the engine must be idle), sync

  The first k steps train on batches sampled by the initial weights (staleness 0, 1, ...,
  k − 1). One batch's sampling overlaps each update, whatever k: with one engine a larger k
  only makes the batches older, which is what a study of staleness needs (benchmarks/
  learning.py). The trainer and the engine must not share a module (the update would change
  the weights under the sampling). ``background=True`` runs the same thread at staleness 0:
  each batch starts only after the previous sync, which gives the synchronous run's numbers
  bit for bit (tests/run/test_source.py): the check that the machinery adds nothing but the
  overlap.

**Provenance.** Every row handed out carries ``policy_version`` (the syncs before the weights
that sampled it) and ``staleness`` (the syncs since then: updates between the sampling weights
and the ones the row is trained from). A row older than ``staleness`` (a resumed
run asked for a smaller bound than its checkpoint's batches) is never trained on: it is
dropped, counted in ``async/dropped_rows`` and warned about, and the next batch is drawn.

Every draw counts: DAPO's refill rounds draw again within a step. A refill takes the next
batch already sampled (by weights one update newer than the step's first batch) and starts
the next one; every batch is drawn in the order the data gives it, as in a synchronous run.
The source's metrics: ``async/staleness`` (mean over the step's rows), ``async/staleness_max``,
``async/dropped_rows`` and ``async/sample_seconds``.

**π_old** (``old_logprobs``; docs/run.md has the table): ``"auto"`` takes the
engine's log-probs exactly when it samples with the trainer's own module at the trainer's
temperature (:func:`samples_with_policy`) and the run is synchronous; ``"recompute"`` leaves
``old_logprobs`` empty, so the trainer takes them from the update's own forward (one optimizer
step) or scores them first; ``"rollout"`` always takes the engine's (the behaviour policy's:
one forward pass less, and the PPO ratio itself carries the off-policy correction). A recipe
that needs π_old before the update (PPO's KL penalty, distillation's and DPO's advantages)
asks :meth:`RolloutSource.with_old_logprobs`.

Threads: the sampling thread runs torch operations with the trainer's intra-op thread count
(``torch.set_num_threads`` is process-wide); on a CPU give each side its share of the cores.
A checkpoint holds the batches sampled ahead and the weight version, so a resumed run trains
on exactly those batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from rlblocks import resharder as resharders
from rlblocks.interfaces import (
    Handle,
    PolicyLoss,
    PolicyTrainer,
    Resharder,
    RolloutEngine,
    Rollouts,
    SamplingParams,
)
from rlblocks.losses.offpolicy import ASYNC_DEFAULT, OffPolicyCorrection
from rlblocks.run.batches import attach_once, mark_closed
from rlblocks.run.loop import OutOfData, Run
from rlblocks.run.options import (
    Correction,
    OldLogprobs,
    RunOptions,
    check_sampling,
)
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


def takes_weights(loss_fn: PolicyLoss) -> bool:
    """True when ``loss_fn`` takes per-token importance weights (``is_weights``, or
    ``**kwargs``): what a correction hands its inner loss."""
    params = inspect.signature(loss_fn).parameters.values()
    return any(p.name == "is_weights" or p.kind is p.VAR_KEYWORD for p in params)


def _name(loss_fn: Any) -> str:
    base = getattr(loss_fn, "func", loss_fn)  # a functools.partial's function
    return getattr(base, "__name__", None) or type(base).__name__


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


class RolloutSource:
    """Each step's rollouts, their π_old, and the sync of the new weights (module docstring).

    ``batches``: prompt batches (``.prompts``, ``.metadata``), drawn as the steps need them;
    ``group_size`` samples per prompt with ``sampling``, or ``sample(batch)`` when given (ReMax
    also samples greedy answers with the same weights). The sampling policy, as keywords or
    from ``run`` (a recipe's `rlblocks.run.RunOptions`, or the `rlblocks.run.Run` built with
    them: its fields of the same names, which the recipe's caller set; one or the other, not
    both):
    ``staleness`` (0: sampled in the step; k: k steps off), ``background``, ``old_logprobs``
    (where π_old comes from), ``correction`` (of the loss, `corrected`) and ``resharder`` (moves
    the trainer's weights into the engine; None: a new `rlblocks.resharder.Resharder`). A
    `Stateful` checkpoint block (the batches sampled ahead, the weight version); its data
    position and resharder are checkpointed beside it (`blocks`). Attached to a
    `rlblocks.run.Run` (``run.driving(source)``), its draws and syncs are timed on the step's
    clock; alone, they are not timed.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        policy: PolicyTrainer,
        batches: Iterable[Any],
        run: Run | RunOptions | None = None,
        *,
        group_size: int,
        sampling: SamplingParams,
        sample: Sample | None = None,
        staleness: int | None = None,
        background: bool | None = None,
        old_logprobs: OldLogprobs | None = None,
        correction: Correction | Literal["unset"] = "unset",
        resharder: Resharder | None = None,
    ) -> None:
        keywords: dict[str, Any] = {"staleness": staleness, "background": background}
        keywords |= {"old_logprobs": old_logprobs, "resharder": resharder}
        given = [k for k, v in keywords.items() if v is not None] + (
            ["correction"] if correction != "unset" else []
        )
        options = run.options if isinstance(run, Run) else run
        if options is not None and given:
            raise TypeError(
                f"RolloutSource: {', '.join(sorted(given))} given both as a keyword and in the "
                "run's RunOptions; pass one of the two"
            )
        defaults = options or RunOptions()  # RunOptions' defaults are the source's
        staleness = defaults.staleness if staleness is None else staleness
        background = defaults.background if background is None else background
        old_logprobs = defaults.old_logprobs if old_logprobs is None else old_logprobs
        correction = defaults.correction if correction == "unset" else correction
        resharder = defaults.resharder if resharder is None else resharder
        check_sampling("RolloutSource", staleness, old_logprobs, correction)
        shares_weights = samples_with_policy(policy, engine, sampling)
        if staleness and shares_weights:
            raise ValueError(
                f"RolloutSource: staleness={staleness} samples while the trainer updates, "
                "but this engine samples with the trainer's own module; build it with its own "
                "copy of the weights (rb.rollout.HFEngine.from_pretrained(...) or around "
                "copy.deepcopy(policy.model)): the resharder then syncs it after every update"
            )
        self.engine, self.policy = engine, policy
        self.staleness, self.background = staleness, background
        self.old_logprobs, self.correction = old_logprobs, correction
        self.resharder: Resharder = resharder or resharders.Resharder()
        self.data = Drawn(batches)
        self.group_size, self.sampling = group_size, sampling
        self._sample_fn = sample
        self.engine_logprobs_are_old = old_logprobs == "rollout" or (
            old_logprobs == "auto" and shares_weights and not staleness
        )
        """True when π_old is the engine's log-probs."""
        threaded = background or staleness > 0
        self._thread = ThreadPoolExecutor(1, "rlblocks-rollout") if threaded else None
        self._run: Run | None = None
        self._ahead: deque[Future[Batch]] = deque()  # sampled or being sampled, in data order
        self.version = 0
        """Weight syncs so far in the run (checkpointed): the version the engine samples with."""
        self._remaining = 0  # steps after the current one
        self._taken: list[tuple[Tensor, float]] = []  # (staleness per row, seconds) this step
        self._dropped = 0  # rows this step found older than the bound

    # ------------------------------------------------------------------ a run's Source
    def attach(self, run: Run) -> None:
        """Driven by ``run`` from now on (its clock times the draws); a second run is
        refused."""
        self._run = attach_once(self, self._run, run)

    def describe(self) -> dict[str, Any]:
        """The sampling policy that changes the numbers, for the run's config."""
        correction = self.correction
        return {
            "staleness": self.staleness,
            "background": self.background,
            "old_logprobs": self.old_logprobs,
            "correction": correction if correction in ("auto", None) else repr(correction),
        }

    def blocks(self) -> dict[str, Any]:
        """The checkpoint's parts: data position, the batches sampled ahead, the resharder."""
        return {"data": self.data, "rollouts": self, "resharder": self.resharder}

    def workers(self) -> dict[str, Any]:
        """The engine and the policy where they can report their stacks (Ray handles), for
        the watchdog's stall report."""
        blocks = {"engine": self.engine, "policy": self.policy}
        return {name: b for name, b in blocks.items() if callable(getattr(b, "stacks", None))}

    def begin(self, index: int, *, remaining: int) -> None:
        """Step ``index`` starts, with ``remaining`` steps after it: nothing is sampled ahead
        that no step would train on."""
        self._remaining = remaining
        self._taken, self._dropped = [], 0

    def metrics(self) -> dict[str, float]:
        """With a background sampler: ``async/staleness`` (updates between the sampling weights
        and the trained ones: mean over the step's rows) and ``async/staleness_max``,
        ``async/dropped_rows`` (rows older than the bound, not trained on) and
        ``async/sample_seconds`` (the sampling's own time, of which ``time/rollout`` is what
        the step waited)."""
        if self._thread is None or not (self._taken or self._dropped):
            return {}
        rows = torch.cat([s for s, _ in self._taken]) if self._taken else torch.zeros(0)
        return {
            "async/staleness": rows.double().mean().item() if len(rows) else float("nan"),
            "async/staleness_max": float(rows.max()) if len(rows) else float("nan"),
            "async/dropped_rows": float(self._dropped),
            "async/sample_seconds": sum(t for _, t in self._taken),
        }

    def resync(self) -> None:
        """Push the restored weights into the engine (it holds the initial ones)."""
        self.resharder.resync(self.policy, self.engine)

    def close(self) -> None:
        """Stop the sampling thread (after its current batch); the source is not driven
        again."""
        mark_closed(self)
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    # ------------------------------------------------------------------ what a recipe calls
    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """``name`` on the driving run's clock, when a step is in progress."""
        run = self._run
        return run.phase(name) if run is not None and run.clock is not None else nullcontext()

    def _note(self, **info: Any) -> None:
        if self._run is not None:
            self._run.note(**info)

    def draw(self) -> Rollouts:
        """The next batch's rollouts, π_old attached as ``old_logprobs`` says, each row
        stamped with ``policy_version`` and ``staleness``; `OutOfData` when the batches ran out
        (the loop ends the run there). Timed as ``rollout``. At staleness k the batches ahead
        are topped up to k (fewer near the run's end) before this returns."""
        rollouts = self._draw()
        if rollouts is None:
            raise OutOfData
        return rollouts

    def rounds(self) -> Iterator[Rollouts]:
        """One `draw` a round until the batches run out (DAPO's dynamic sampling); when they
        ran out before the first round, `OutOfData` (the run ends there, as after `draw`)."""
        yield self.draw()
        while (rollouts := self._draw()) is not None:
            yield rollouts

    def _draw(self) -> Rollouts | None:
        with self._phase("rollout"):
            batch = self._fresh()
        if batch is None:
            return None
        check_replayed(batch.rollouts, self.sampling, self.engine)  # before sampling more
        for _ in range(min(self.staleness, self._remaining) - len(self._ahead)):
            if not self._submit():
                break
        staleness = self.version - batch.version
        rows = len(batch.rollouts)
        self._taken.append((torch.full((rows,), staleness), batch.seconds))
        rollouts = batch.rollouts.replace(
            policy_version=torch.full((rows,), batch.version, dtype=torch.long),
            staleness=torch.full((rows,), staleness, dtype=torch.long),
        )
        if self.engine_logprobs_are_old:
            rollouts = rollouts.replace(old_logprobs=rollouts.rollout_logprobs)
        return rollouts

    def _fresh(self) -> Batch | None:
        """The next batch within the staleness bound: older ones are dropped and counted."""
        while True:
            if not self._ahead and not self._submit(now=True):
                return None
            self._note(**getattr(self._ahead[0], "note", {}))  # what the wait is for (watchdog)
            batch = self._take()
            if self.version - batch.version <= self.staleness:
                return batch
            self._dropped += len(batch.rollouts)
            warnings.warn(
                f"RolloutSource: dropped {len(batch.rollouts)} rows sampled by weight version "
                f"{batch.version}, {self.version - batch.version} updates old, beyond "
                f"staleness={self.staleness}; they are not trained on (async/dropped_rows)",
                UserWarning,
                stacklevel=4,
            )

    def corrected(self, loss_fn: PolicyLoss) -> PolicyLoss:
        """The recipe's policy loss with ``correction`` applied (`RunOptions.correction`):
        unchanged when π_old is the engine's, or under ``"auto"`` at staleness 0 or for a loss
        that already is an `rlblocks.losses.OffPolicyCorrection`."""
        choice = self.correction
        if choice is None or self.engine_logprobs_are_old:
            return loss_fn
        if choice == "auto" and (not self.staleness or isinstance(loss_fn, OffPolicyCorrection)):
            return loss_fn
        if not takes_weights(loss_fn):
            if choice == "auto":
                warnings.warn(
                    f"RolloutSource: staleness={self.staleness}, but the loss "
                    f"{_name(loss_fn)} takes no is_weights, so the stale rows are trained on "
                    "uncorrected; give it an is_weights keyword, or pass "
                    "correction=None (RolloutSource or RunOptions) to say so",
                    UserWarning,
                    stacklevel=3,
                )
                return loss_fn
            raise ValueError(
                f"RolloutSource: correction weights the loss per token, but "
                f"{_name(loss_fn)} takes no is_weights keyword; add one (the built-in losses "
                "have it), or pass correction=None"
            )
        return (ASYNC_DEFAULT if choice == "auto" else choice)(loss_fn)

    def with_old_logprobs(self, rollouts: Rollouts) -> Rollouts:
        """``rollouts`` with π_old filled now, for a recipe that needs it before the update:
        as drawn, else scored by the trainer (timed as ``logprobs``)."""
        if rollouts.old_logprobs is not None:
            return rollouts
        with self._phase("logprobs"):
            return rollouts.replace(old_logprobs=self.policy.logprobs(rollouts))

    def sync(self) -> dict[str, float]:
        """Wait until every batch started ahead is sampled (the engine must be idle; timed as
        ``rollout``), then move the trainer's new weights into the engine (``sync``)."""
        if self._ahead:
            with self._phase("rollout"):
                for ahead in self._ahead:
                    ahead.exception()  # waits; an error is raised by the draw that takes it
        with self._phase("sync"):
            metrics = self.resharder.sync(self.policy, self.engine)
        self.version += 1
        return metrics

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        """The weight version and the batches sampled ahead, complete: they are part of the
        run. Each as its fields in a plain dict, so that a checkpoint holds it as data."""
        ahead = []
        for future in self._ahead:
            batch = future.result()
            fields = {f.name: getattr(batch.rollouts, f.name) for f in dataclasses.fields(Rollouts)}
            ahead.append({"rollouts": fields, "version": batch.version, "seconds": batch.seconds})
        return {"version": self.version, "ahead": ahead}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved (or the one batch ahead of a checkpoint written
        before the version was saved)."""
        saved = state["ahead"]
        if saved is None or isinstance(saved, Mapping):  # the earlier form: at most one batch
            self.version = 0 if saved is None else 1  # the batch it holds was one update old
            saved = [] if saved is None else [{**state, "rollouts": saved, "version": 0}]
        else:
            self.version = int(state["version"])
        if saved and self._thread is None:
            raise ValueError(
                f"RolloutSource: the checkpoint holds {len(saved)} batch(es) sampled ahead; "
                "resume it with staleness=k, k >= 1 (RolloutSource, or a recipe's RunOptions; batches older than "
                "k are then dropped and counted)"
            )
        self._ahead.clear()
        for entry in saved:
            done: Future[Batch] = Future()
            rollouts = Rollouts(**entry["rollouts"])
            done.set_result(Batch(rollouts, int(entry["version"]), float(entry["seconds"])))
            self._ahead.append(done)

    # ------------------------------------------------------------------ internals
    def _submit(self, *, now: bool = False) -> bool:
        """Start sampling the next batch (in the thread, or ``now``: noted for the watchdog); False
        when there is none."""
        batch = next(self.data, None)
        if batch is None:
            return False
        prompts = list(getattr(batch, "prompts", None) or [])
        note = (
            {
                "rows": f"{len(prompts) * self.group_size} ({self.group_size} samples of "
                f"{len(prompts)} prompts, sampled by weights version {self.version})",
                "prompts": [str(p)[:120] for p in prompts[:3]],
            }
            if prompts
            else {"batch": f"a {type(batch).__name__}, weights version {self.version}"}
        )
        if self._thread is None:
            if now:
                self._note(**note)  # sampled right here: the watchdog's report names it
            done: Future[Batch] = Future()
            done.set_result(self._sample(batch, self.version))
            self._ahead.append(done)
        else:
            future = self._thread.submit(self._sample, batch, self.version)
            future.note = note  # type: ignore[attr-defined]  # read by _fresh for the watchdog
            self._ahead.append(future)
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
        return self._ahead.popleft().result()  # an error in the thread is raised here


__all__ = [
    "Batch",
    "RolloutSource",
    "Sample",
    "check_replayed",
    "samples_with_policy",
]
