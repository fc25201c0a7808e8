"""`RunOptions`: a recipe's ``run=``, how its run is driven, in one object.

A recipe takes its algorithm's blocks and hyperparameters, and ``run=``::

    run = rb.run.RunOptions(checkpoint="runs/grpo", resume="auto", staleness=1)
    rb.recipes.grpo(policy, engine, reward, batches, steps=100, run=run)

The recipe hands the loop's fields (`LOOP_FIELDS`: ``on_step``, ``progress``, ``checkpoint``,
``resume``, ``tracker``, ``watchdog``) to its `rlblocks.run.Run`, and the sampling policy
(`SOURCE_FIELDS`: ``staleness``, ``background``, ``old_logprobs``, ``correction``,
``resharder``) to its `rlblocks.run.RolloutSource` (the source's fourth argument): where each
step's rollouts and their π_old come from, how the loss corrects for the difference, and how
the new weights reach the engine. A loop of one's own passes them to the two blocks directly.
The decision table of ``old_logprobs`` is written once, in docs/run.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from rlblocks.interfaces import PolicyLoss, Rollouts

if TYPE_CHECKING:
    from rlblocks.checkpoint import Checkpointer, Resume
    from rlblocks.interfaces import Resharder
    from rlblocks.run.watchdog import Watchdog

#: ``RunOptions.correction``: ``"auto"``, None, or ``loss -> corrected loss``.
Correction = Literal["auto"] | Callable[[PolicyLoss], PolicyLoss] | None

OldLogprobs = Literal["auto", "recompute", "rollout"]
"""Where π_old comes from (docs/run.md): ``"auto"``, ``"recompute"`` or ``"rollout"``."""

StepCallback = Callable[[int, dict[str, Any], Rollouts | None], None]
"""``on_step(step, metrics, rollouts)``, called after every step (``rollouts`` is None for a
step that trained on nothing: DAPO's skipped step); raise ``StopIteration`` in it to end the run
early."""


class Tracker(Protocol):
    """What the loop asks of a tracker (``rb.tracking.Tracker``)."""

    def start(self, config: Mapping[str, Any], *, resume_step: int | None = None) -> None:
        """Record the run's configuration; ``resume_step``: the step a resumed run starts from."""

    def log(self, step: int, metrics: Mapping[str, Any], rollouts: Rollouts | None = None) -> Any:
        """Record one step's metrics (and samples from its rollouts, when given)."""


@dataclass(frozen=True)
class RunOptions:
    """How a recipe's run is driven: the loop's options and the rollout source's (module
    docstring)."""

    on_step: StepCallback | None = None
    """Called after every step with ``(step, metrics, rollouts)``; ``StopIteration`` ends the run."""
    progress: bool = True
    """Show a progress bar (tqdm) with the step's reward, or its loss when it has no reward."""
    checkpoint: Checkpointer | str | Path | None = None
    """A `rlblocks.checkpoint.Checkpointer`, or a folder for one that saves every step."""
    resume: Resume = False
    """False: refuse a folder holding a checkpoint; True: resume from its newest; ``"auto"``:
    resume if there is one."""
    tracker: Tracker | None = None
    """A `rlblocks.tracking.Tracker`: the run's config once, every step's metrics."""
    staleness: int = 0
    """Updates between the weights that sample a batch and those it is trained from: 0 samples
    in the step (synchronous); k >= 1 samples ahead while the trainer updates, so that the batch
    of step t was sampled by the weights of step t - k (k = 1: one step off; the engine needs
    its own copy of the weights). Rows older than this are never trained on."""
    background: bool = False
    """Sample in a background thread even at staleness 0 (staleness 1 always does): the same
    machinery with nothing overlapped, the check that it changes no number."""
    old_logprobs: OldLogprobs = "auto"
    """π_old, the denominator of the PPO ratio: ``"auto"`` takes the engine's log-probs exactly
    when it samples with the trainer's own module at its temperature and staleness 0, else the
    trainer's; ``"recompute"``: always the trainer's (from the update's own forward when it is
    one optimizer step, else a scoring pass before it); ``"rollout"``: always the engine's."""
    correction: Correction = "auto"
    """The off-policy correction of the recipe's policy loss (`rlblocks.losses.offpolicy`),
    applied when π_old is the trainer's (not with ``old_logprobs="rollout"``): ``"auto"`` wraps
    it in IcePop's token mask (``rb.losses.MaskedIS(loss, low=0.5, high=2.0)``) at staleness
    >= 1 and leaves it as it is at staleness 0 or when it already is a correction; a callable
    ``loss -> loss`` (``functools.partial(rb.losses.TruncatedIS, cap=2.0)``) wraps it at every
    staleness; None never wraps it."""
    resharder: Resharder | None = None
    """How the trained weights reach the engine after each update (`rlblocks.interfaces.Resharder`);
    None: a new ``rb.resharder.Resharder()`` (256 MiB buckets). Checkpointed with the run."""
    watchdog: Watchdog | None = None
    """Deadlines per phase and a report naming the phase, the rows in flight and every
    thread's stack when one passes (`rlblocks.run.watchdog.Watchdog`); None: no watchdog."""

    def __post_init__(self) -> None:
        check_sampling("RunOptions", self.staleness, self.old_logprobs, self.correction)
        if self.resume not in (False, True, "auto"):
            raise ValueError(
                f"RunOptions.resume: {self.resume!r} is not a resume mode; use False, True or "
                f"'auto'"
            )
        if self.resume is True and self.checkpoint is None:
            raise ValueError(
                "RunOptions.resume: resume=True has no folder to resume from; pass checkpoint="
            )


#: `RunOptions` fields read by the run's loop (`rlblocks.run.Run`).
LOOP_FIELDS = frozenset({"on_step", "progress", "checkpoint", "resume", "tracker", "watchdog"})

#: `RunOptions` fields read by the rollout source (`rlblocks.run.RolloutSource`).
SOURCE_FIELDS = frozenset({"staleness", "background", "old_logprobs", "correction", "resharder"})


def check_sampling(owner: str, staleness: Any, old_logprobs: Any, correction: Any) -> None:
    """Refuse a sampling policy that cannot run, naming ``owner``, where it was passed
    (``RunOptions``, ``RolloutSource``) and the field: the first failing check of the table,
    in order (a staleness that is no integer is not compared with 0)."""
    whole = isinstance(staleness, int) and not isinstance(staleness, bool)
    checks: list[tuple[bool, type[Exception], str]] = [
        (
            not whole,
            TypeError,
            (
                f"staleness: {staleness!r} is not a whole number of updates; pass 0 "
                "(synchronous) or k >= 1 (k steps off)"
            ),
        ),
        (
            whole and staleness < 0,
            ValueError,
            f"staleness: {staleness} is negative; pass 0 (synchronous) or k >= 1 (k steps off)",
        ),
        (
            old_logprobs not in ("auto", "recompute", "rollout"),
            ValueError,
            (
                f"old_logprobs: {old_logprobs!r} is not a source of π_old; use 'auto', "
                "'recompute' or 'rollout'"
            ),
        ),
        (
            not (correction in ("auto", None) or callable(correction)),
            ValueError,
            (
                f"correction: {correction!r} is not a correction; pass 'auto', None, or a loss "
                "wrapper such as functools.partial(rb.losses.TruncatedIS, cap=2.0)"
            ),
        ),
        (
            callable(correction) and old_logprobs == "rollout",
            ValueError,
            (
                "correction: a correction weights by π_old / π_rollout, but "
                "old_logprobs='rollout' makes π_old the engine's log-probs (the ratio is 1); pass "
                "old_logprobs='recompute' or 'auto', or correction=None"
            ),
        ),
    ]
    for failed, error, message in checks:
        if failed:
            raise error(f"{owner}.{message}")


__all__ = [
    "LOOP_FIELDS",
    "SOURCE_FIELDS",
    "OldLogprobs",
    "RunOptions",
    "StepCallback",
    "Tracker",
    "check_sampling",
]
