"""Rollouts for a recipe's steps, sampled in step, or one step ahead while the trainer trains.

A synchronous step samples, scores, updates, then syncs the new weights into the engine: the
engine idles during the update and the trainer during the sampling. With `OneStepOff` the
engine samples batch k + 1 in a background thread while the trainer updates on batch k (the
"one-step-off" pipeline of verl's ``one_step_off_policy`` recipe and of AReaL / PipelineRL
with a staleness bound of one):

    step k:  take the rollouts of batch k (sampled during step k − 1, by θ_{k−1})
             start sampling batch k + 1 with the engine's weights (θ_{k−1}, synced after k − 1)
             reward, advantages, update on batch k: θ_{k−1} → θ_k
             wait for the sampling to finish (the engine must be idle), sync θ_k into it

So every batch but the first is sampled by the weights one update older than those it is
trained from (``staleness`` 1). The trainer and the engine must not share a module: the update
would change the weights under the sampling. ``staleness=0`` starts each batch only after the
previous sync, i.e. the synchronous loop run through the same thread: it gives the synchronous
loop's metrics and weights bit for bit (tests/recipes/test_overlap.py), which is what checks
that the machinery adds nothing but the overlap.

π_old, the denominator of the PPO ratio, is the explicit choice (``old_logprobs``):

- ``"recompute"`` (default): the trainer scores the batch with its current weights θ_{k−1}
  before the update, as verl's one-step-off recipe does. The ratio starts at 1 and the
  clip bounds the update's step; the gap between the sampling weights θ_{k−2} and θ_{k−1} is
  not corrected unless the loss is wrapped in `rlblocks.losses.TruncatedIS`, which weights
  each token by min(π_old / π_rollout, C) (Yao et al. 2025).
- ``"rollout"``: π_old is the engine's log-probs, the behaviour policy's, so the PPO ratio
  itself carries the off-policy correction (and the clip bounds it): one forward pass less
  per step.

Threads: the sampling thread runs torch operations with the same intra-op thread count as the
trainer (``torch.set_num_threads`` is process-wide). On a CPU, give each side its share of the
cores, e.g. ``torch.set_num_threads(cores // 2)``; with one thread each the two sides run on
two cores. A Ray engine works the same way: the thread only waits for its workers.

A checkpoint holds the rollouts sampled ahead (state of the `Rollouts` block), so a resumed run
trains on exactly the batch the interrupted one had sampled.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from rlblocks.interfaces import RolloutEngine, Rollouts, SamplingParams
from rlblocks.recipes.defaults import samples_with_policy
from rlblocks.recipes.loop import Clock


@dataclass(frozen=True)
class OneStepOff:
    """Sample the next batch while the trainer updates on this one (module docstring)."""

    staleness: int = 1
    """Updates between the weights that sample a batch and those it is trained from: 1
    overlaps sampling with the update; 0 is the synchronous loop (the equivalence check)."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """π_old: scored by the trainer before the update, or the engine's log-probs."""

    def __post_init__(self) -> None:
        if self.staleness not in (0, 1):
            raise ValueError(f"OneStepOff.staleness must be 0 or 1, got {self.staleness}")
        if self.old_logprobs not in ("recompute", "rollout"):
            raise ValueError(
                f"OneStepOff.old_logprobs must be 'recompute' or 'rollout', "
                f"got {self.old_logprobs!r}"
            )


class Sampled:
    """The rollouts of each step: sampled in the step (``overlap=None``), or started a step
    ahead in a background thread (`OneStepOff`), and where their π_old comes from. A
    `Stateful` checkpoint block: it saves the batch sampled ahead.

    ``reuse_rollout_logprobs`` is the recipes' argument: None takes the engine's log-probs as
    π_old exactly when ``engine`` samples with ``policy``'s own module
    (`rlblocks.recipes.defaults.samples_with_policy`); True always, False never (unless
    ``OneStepOff(old_logprobs="rollout")`` asks for them)."""

    def __init__(
        self,
        engine: RolloutEngine,
        policy: Any,
        *,
        group_size: int,
        sampling: SamplingParams,
        overlap: OneStepOff | None = None,
        reuse_rollout_logprobs: bool | None = None,
    ) -> None:
        shares_weights = samples_with_policy(policy, engine, sampling)
        if overlap is not None and overlap.staleness and shares_weights:
            raise ValueError(
                "OneStepOff(staleness=1) needs an engine with its own copy of the weights: this "
                "HFEngine samples with the trainer's own module, which the update changes "
                "under it. Build it with rb.rollout.HFEngine.from_pretrained(...) or around "
                "copy.deepcopy(policy.model); the resharder then syncs it after every update"
            )
        self.engine, self.group_size, self.sampling = engine, group_size, sampling
        self.overlap = overlap
        reuse = shares_weights if reuse_rollout_logprobs is None else reuse_rollout_logprobs
        self.engine_logprobs_are_old = reuse or (
            overlap is not None and overlap.old_logprobs == "rollout"
        )
        """True when π_old is the engine's log-probs (`with_old_logprobs`)."""
        self._thread = (
            ThreadPoolExecutor(1, thread_name_prefix="rlblocks-rollout") if overlap else None
        )
        self._ahead: Future[tuple[Rollouts, float]] | None = None
        self._seconds = 0.0  # the sampling seconds of the batch just taken

    def next(
        self, batches: Iterator[Any], clock: Clock, *, ahead: bool = True
    ) -> tuple[Rollouts, dict] | None:
        """This step's rollouts and their metrics (``async/staleness``, ``async/sample_seconds``,
        the sampling's own time, of which ``time/rollout`` is what the step waited); None when
        ``batches`` ran out. With an overlap the next batch starts sampling before this
        returns, unless ``ahead`` is False (the run's last step)."""
        with clock("rollout"):
            staleness = 0.0
            if self._ahead is not None:  # sampled during the last step, by the older weights
                rollouts, seconds = self._take()
                staleness = 1.0
            else:
                batch = next(batches, None)
                if batch is None:
                    return None
                if self._thread is None:
                    rollouts, seconds = self._sample(batch)
                else:  # staleness 0, or the first step: through the thread all the same
                    self._ahead = self._thread.submit(self._sample, batch)
                    rollouts, seconds = self._take()
        if ahead and self.overlap is not None and self.overlap.staleness:
            batch = next(batches, None)
            if batch is not None:
                self._ahead = self._thread.submit(self._sample, batch)
        metrics = {"async/staleness": staleness, "async/sample_seconds": seconds}
        return rollouts, metrics if self.overlap else {}

    def with_old_logprobs(self, rollouts: Rollouts) -> Rollouts:
        """``rollouts`` with π_old set to the engine's log-probs where that is the choice
        (`engine_logprobs_are_old`); otherwise as they are, for the trainer to score."""
        if self.engine_logprobs_are_old:
            return rollouts.replace(old_logprobs=rollouts.rollout_logprobs)
        return rollouts

    def wait(self, clock: Clock) -> None:
        """Block until the batch sampled ahead is complete: the engine is idle, its weights can
        be synced. What is left to wait is timed as ``rollout``."""
        if self._ahead is not None:
            with clock("rollout"):
                self._ahead.exception()  # waits; an error is raised by the next take

    def close(self) -> None:
        """Stop the sampling thread (after its current batch)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        """The batch sampled ahead (None without one), complete: it is part of the run."""
        if self._ahead is None:
            return {"ahead": None}
        rollouts, seconds = self._ahead.result()
        return {"ahead": rollouts, "seconds": seconds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved."""
        self._ahead = None
        if state["ahead"] is not None:
            if self._thread is None:
                raise ValueError(
                    "the checkpoint holds a batch sampled one step ahead (OneStepOff): resume "
                    "it with the same async_rollout"
                )
            done: Future[tuple[Rollouts, float]] = Future()
            done.set_result((state["ahead"], float(state["seconds"])))
            self._ahead = done

    # ------------------------------------------------------------------ internals
    def _sample(self, batch: Any) -> tuple[Rollouts, float]:
        start = time.perf_counter()
        rollouts = self.engine.generate(
            batch.prompts, n=self.group_size, sampling=self.sampling, metadata=batch.metadata
        )
        return rollouts, time.perf_counter() - start

    def _take(self) -> tuple[Rollouts, float]:
        ahead, self._ahead = self._ahead, None
        return ahead.result()  # an error in the thread is raised here, in the step
