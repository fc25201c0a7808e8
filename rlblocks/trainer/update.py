"""The one update loop of every trainer: epochs × mini-batches × micro-batches.

``PolicyTrainer.step`` and ``CriticTrainer.step`` both come down to :func:`run_update`; each
trainer supplies only what is its own, the loss of one micro-batch (a :data:`MicroLoss`):

1. The plan: the rows of each optimizer step, epoch after epoch (:func:`draw_plan`; shuffled
   by ``(config.shuffle_seed, trainer.steps)`` so a restored trainer repeats it).
2. One normalizer per mini-batch, ``config.aggregation.normalizer(mask)`` over the *whole*
   mini-batch (:func:`normalizers`): every data-parallel rank holds the whole batch, so the
   group-wide normalizer needs no collective.
3. This rank's share of every mini-batch (``trainer.dp.share``; all of it in one process).
4. Per mini-batch: per micro-batch forward, loss (aggregated with that normalizer), backward;
   then the NaN guard decides for the whole group, clips, steps AdamW and the schedule. Padding
   micro-batches (``DataParallel.aligned``) run with zero weight so that FSDP's collectives
   match across ranks, and count for nothing.

Step 4 is two functions, :func:`accumulate` (the micro-batches' forward and backward) and
:func:`apply_update` (NaN guard, clip, AdamW, schedule, counters). A mini-batch of
:func:`run_update` is one of each; ``PolicyTrainer.forward_backward`` and ``optim_step``
(Tinker's primitives, for a loop of one's own) call them separately, any number of
accumulations before one apply, through an :class:`Accumulation`.

Metrics are token-weighted over the real micro-batches of the applied steps and summed over
ranks (``rlblocks.trainer.metrics``), so every rank returns the metrics of the whole group.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rlblocks.rollouts import Rollouts
from rlblocks.trainer.batches import micro_batch_pairs, minibatch_rows
from rlblocks.trainer.config import TrainConfig, optimizer_and_schedule
from rlblocks.trainer.guard import guarded_step
from rlblocks.trainer.metrics import StepMetrics
from rlblocks.trainer.packing import check_isolation, kept_apart
from rlblocks.trainer.parallel import DataParallel, SingleProcess

#: ``micro_loss(micro, normalizer) -> (loss, metrics)``: the aggregated loss of one micro-batch
#: (a scalar with gradient, already divided by the mini-batch ``normalizer``) and its metrics,
#: each a mean over the micro-batch's valid tokens (detached scalars).
MicroLoss = Callable[[Rollouts, Tensor], tuple[Tensor, dict[str, Tensor]]]


class Trainable(Protocol):
    """What the loop reads and advances on a trainer."""

    # Read only here (a trainer may hold a narrower module: the critic's ValueModel).
    @property
    def model(self) -> nn.Module:
        """The module being trained."""

    @property
    def config(self) -> TrainConfig:
        """Batching, optimizer and numerics."""

    @property
    def dp(self) -> SingleProcess | DataParallel:
        """The data-parallel group (a ``SingleProcess`` in one process)."""

    # Set by start_training and rebuild_optimizer, advanced by the loop.
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR  # optimizer_and_schedule builds a LambdaLR
    steps: int
    optimizer_steps: int
    skipped_steps: int


def start_training(trainer: Trainable) -> None:
    """The end of a trainer's ``__init__``: zero the counters the loop advances, build the
    optimizer (:func:`rebuild_optimizer`) and, with ``config.packing``, check that the model
    keeps packed rows apart (``rlblocks.trainer.packing.check_isolation``; a value model's
    backbone)."""
    trainer.steps = 0  # step() calls
    trainer.optimizer_steps = 0  # applied updates
    trainer.skipped_steps = 0  # updates refused by the NaN guard
    rebuild_optimizer(trainer)
    if trainer.config.packing:  # refuse a model that mixes packed rows before any step
        check_isolation(
            getattr(trainer.model, "backbone", trainer.model), owner=type(trainer).__name__
        )


def rebuild_optimizer(trainer: Trainable) -> None:
    """A fresh AdamW and schedule on the current trainable parameters (after sharding).

    The ``rebuild_optimizer`` method of ``PolicyTrainer`` and ``CriticTrainer``."""
    trainer.optimizer, trainer.scheduler = optimizer_and_schedule(
        trainer.model, trainer.config, owner=type(trainer).__name__
    )


class Trained:
    """The base of ``PolicyTrainer`` and ``CriticTrainer``: the state the update loop keeps on
    the trainer (set by :func:`start_training` and :func:`rebuild_optimizer`, advanced by
    :func:`run_update`) and the ``rebuild_optimizer`` method."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR  # optimizer_and_schedule builds a LambdaLR
    steps: int  # step() calls
    optimizer_steps: int  # applied updates
    skipped_steps: int  # updates refused by the NaN guard

    rebuild_optimizer = rebuild_optimizer  # a fresh AdamW and schedule


@dataclass(frozen=True)
class Assignment:
    """This rank's part of an update (all of it in one process)."""

    batch: Rollouts
    """The rows this rank trains on."""
    plan: list[Tensor]
    """Each mini-batch's rows on this rank, as indices into ``batch``."""
    norms: list[Tensor]
    """Each whole mini-batch's normalizer (the same on every rank)."""
    owned: Tensor
    """(len(batch)) bool: the rows this rank counts in batch-wide metrics."""


def assign(
    trainer: Trainable,
    batch: Rollouts,
    minibatches: Sequence[Tensor] | None = None,
    *,
    method: str = "step",
) -> Assignment:
    """Steps 1 to 3 of the module docstring for ``batch`` (the whole batch, on every rank);
    ``method`` names the trainer's method in the error an empty batch raises."""
    if len(batch) == 0:
        raise ValueError(
            f"{type(trainer).__name__}.{method}: empty batch (no row); pass at least one rollout"
        )
    plan = draw_plan(len(batch), trainer.config, trainer.steps, minibatches)
    share = trainer.dp.share(batch, plan)
    norms = normalizers(batch, plan, trainer.config)
    return Assignment(batch.select(share.rows), share.plan, norms, share.owned)


def draw_plan(
    b: int, config: TrainConfig, steps: int, minibatches: Sequence[Tensor] | None = None
) -> list[Tensor]:
    """Row indices of each optimizer step of an update of ``b`` rows: ``minibatches`` when
    given, else :func:`~rlblocks.trainer.batches.minibatch_rows` seeded by
    ``(config.shuffle_seed, steps)``."""
    if minibatches is not None:
        return [torch.as_tensor(rows, dtype=torch.long) for rows in minibatches]
    seed = (config.shuffle_seed, steps)
    return list(minibatch_rows(b, size=config.mini_batch_size, epochs=config.epochs, seed=seed))


def normalizers(batch: Rollouts, plan: Sequence[Tensor], config: TrainConfig) -> list[Tensor]:
    """``config.aggregation.normalizer`` of each whole mini-batch's response mask."""
    return [config.aggregation.normalizer(batch.response_mask[rows]) for rows in plan]


def run_update(trainer: Trainable, work: Assignment, micro_loss: MicroLoss) -> dict[str, float]:
    """Train ``trainer`` on its :class:`Assignment` mini-batch by mini-batch (module doc step 4).

    ``work.batch`` must carry what ``micro_loss`` reads (old log-probs, advantages, …). Counts
    the call in ``trainer.steps`` and applied / skipped updates in
    ``trainer.optimizer_steps`` / ``skipped_steps``. Returns the token-weighted metrics,
    ``loss`` (mean mini-batch loss), ``grad_norm`` (mean pre-clipping norm), ``lr`` (of the
    last applied update), ``optimizer_steps`` and ``skipped_steps`` (of this call), the same on
    every rank; metrics of skipped updates are left out (NaN if all were skipped).
    """
    metrics = StepMetrics()
    applied, skipped = trainer.optimizer_steps, trainer.skipped_steps
    last_lr = trainer.scheduler.get_last_lr()[0]
    trainer.model.train()  # Hugging Face gradient checkpointing runs in training mode only
    try:
        for rows, normalizer in zip(work.plan, work.norms, strict=True):
            lr = trainer.scheduler.get_last_lr()[0]
            finite = accumulate(trainer, work.batch.select(rows), normalizer, micro_loss, metrics)
            ok, grad_norm = apply_update(trainer, finite)
            if ok:
                metrics.commit(grad_norm)
                last_lr = lr
            else:
                metrics.discard()
    finally:
        trainer.model.eval()
        trainer.optimizer.zero_grad(set_to_none=True)
    trainer.steps += 1
    return {
        **metrics.summary(reduce=trainer.dp.all_sum),
        "lr": float(last_lr),
        "optimizer_steps": float(trainer.optimizer_steps - applied),
        "skipped_steps": float(trainer.skipped_steps - skipped),
    }


def accumulate(
    trainer: Trainable,
    mini: Rollouts,
    normalizer: Tensor,
    micro_loss: MicroLoss,
    metrics: StepMetrics,
) -> Tensor:
    """Add the gradient of this rank's rows ``mini`` (a mini-batch, or a part of one divided by
    the whole one's ``normalizer``) to the parameters' ``.grad``, micro-batch by micro-batch,
    and their losses and metrics to ``metrics`` (pending). Returns this rank's bool scalar:
    True when every micro-batch loss was finite. The model must be in training mode."""
    device = next(trainer.model.parameters()).device
    finite = torch.ones((), dtype=torch.bool, device=device)
    pairs, _ = micro_batch_pairs(mini, trainer.config, trainer.dp)  # any order: a sum
    for micro, real in pairs:
        micro = micro.trim()
        # A packed forward's row attention must last through its backward (recomputed layers).
        with kept_apart(trainer.model) if trainer.config.packing else contextlib.nullcontext():
            loss, loss_metrics = micro_loss(micro, normalizer)
            if not real:  # a padding micro-batch: FSDP's collectives run, nothing is added
                loss = loss * 0.0
            if loss.requires_grad:
                loss.backward()
        if real:
            metrics.add_micro_batch(loss, loss_metrics, tokens=micro.response_mask.sum())
            finite &= torch.isfinite(loss.detach())
    return finite


def apply_update(trainer: Trainable, finite: Tensor) -> tuple[bool, Tensor]:
    """Apply the accumulated gradient (True) or skip it (False): the NaN guard decides for the
    whole group (``finite`` is this rank's flag), then clip, AdamW, schedule, zeroed
    gradients (``rlblocks.trainer.guard``) and the counters. Also returns the pre-clipping
    gradient norm."""
    finite = trainer.dp.all_true(finite)  # every rank applies the step or none does
    ok, grad_norm = guarded_step(
        trainer.optimizer,
        trainer.scheduler,
        finite=finite,
        max_grad_norm=trainer.config.max_grad_norm,
        owner=type(trainer).__name__,
    )
    if ok:
        trainer.optimizer_steps += 1
    else:
        trainer.skipped_steps += 1
    return ok, grad_norm


class Accumulation:
    """The gradient that ``forward_backward`` calls added since the last ``optim_step``.

    Tinker's primitives (``PolicyTrainer.forward_backward`` and ``optim_step``) are the two
    halves of one mini-batch of :func:`run_update`: :meth:`add` is :func:`accumulate` over one
    call's rows, :meth:`apply` is :func:`apply_update` over everything added since the last
    apply. The gradient itself lives in the parameters' ``.grad``; this object holds whether
    any is pending and this rank's NaN flag over all of it.
    """

    def __init__(self) -> None:
        self.finite: Tensor | None = None  # this rank: every pending loss finite; None: none

    @property
    def pending(self) -> bool:
        """True when gradients were accumulated since the last :meth:`apply` (or :meth:`drop`)."""
        return self.finite is not None

    def add(self, trainer: Trainable, work: Assignment, micro_loss: MicroLoss) -> dict[str, float]:
        """Forward and backward of ``work``'s one mini-batch, its gradient added to what is
        pending. Returns this call's ``loss`` (the sum of its micro-batch losses over every rank:
        its share of the loss of the batch whose normalizer it used) and its token-weighted
        loss metrics, the same on every rank. An error part-way drops everything pending: a
        gradient summed over part of the micro-batches is no gradient to apply."""
        (rows,), (normalizer,) = work.plan, work.norms
        metrics = StepMetrics()
        trainer.model.train()  # Hugging Face gradient checkpointing runs in training mode only
        try:
            finite = accumulate(trainer, work.batch.select(rows), normalizer, micro_loss, metrics)
        except BaseException:
            self.drop(trainer)
            raise
        finally:
            trainer.model.eval()
        self.finite = finite if self.finite is None else self.finite & finite
        metrics.commit(None)  # this call's numbers, whatever optim_step decides later
        summary = metrics.summary(reduce=trainer.dp.all_sum)
        del summary["grad_norm"]  # no step yet
        return summary

    def apply(self, trainer: Trainable) -> dict[str, float]:
        """Apply (or, by the NaN guard, skip) everything pending: ``grad_norm`` (pre-clipping;
        NaN when skipped), ``lr`` (of this update), ``optimizer_steps`` and ``skipped_steps``
        (1.0 / 0.0). Raises ``RuntimeError`` when nothing is pending."""
        if self.finite is None:
            raise RuntimeError(
                f"{type(trainer).__name__}.optim_step: no gradient to apply; call "
                "forward_backward first (nothing was accumulated since the last optim_step)"
            )
        lr = trainer.scheduler.get_last_lr()[0]
        try:
            ok, grad_norm = apply_update(trainer, self.finite)
        finally:
            self.drop(trainer)  # applied, skipped or failed: nothing stays pending
        return {
            "grad_norm": float(grad_norm) if ok else math.nan,
            "lr": float(lr),
            "optimizer_steps": float(ok),
            "skipped_steps": float(not ok),
        }

    def refuse(self, trainer: Trainable, method: str) -> None:
        """Raise ``RuntimeError`` when gradients are pending: ``method`` (a checkpoint, a
        ``step``) would lose them or mix them into its own update."""
        if self.pending:
            raise RuntimeError(
                f"{type(trainer).__name__}.{method}: gradients from forward_backward are pending "
                f"(not applied yet); call optim_step before {method}, which would lose or mix them"
            )

    def drop(self, trainer: Trainable) -> None:
        """Forget everything pending: zero the gradients."""
        trainer.optimizer.zero_grad(set_to_none=True)
        self.finite = None


def timing(
    dp: SingleProcess | DataParallel, seconds: float, scoring: float, tokens: int, epochs: int
) -> dict[str, Any]:
    """``seconds`` and ``logprob_seconds`` of the slowest rank, ``tokens_per_second`` of the
    group (the batch's real tokens × epochs over the slowest rank's seconds)."""
    seconds, scoring = dp.all_max(seconds), dp.all_max(scoring)
    return {
        "seconds": seconds,
        "logprob_seconds": scoring,
        "tokens_per_second": tokens * epochs / max(seconds, 1e-9),
    }
