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

Metrics are token-weighted over the real micro-batches of the applied steps and summed over
ranks (``rlblocks.trainer.metrics``), so every rank returns the metrics of the whole group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rlblocks.rollouts import Rollouts
from rlblocks.trainer.batches import micro_batch_pairs, minibatch_rows
from rlblocks.trainer.config import TrainConfig
from rlblocks.trainer.guard import guarded_step
from rlblocks.trainer.metrics import StepMetrics
from rlblocks.trainer.parallel import DataParallel, SingleProcess

#: ``micro_loss(micro, normalizer) -> (loss, metrics)``: the aggregated loss of one micro-batch
#: (a scalar with gradient, already divided by the mini-batch ``normalizer``) and its metrics,
#: each a mean over the micro-batch's valid tokens (detached scalars).
MicroLoss = Callable[[Rollouts, Tensor], tuple[Tensor, dict[str, Tensor]]]


class Trainable(Protocol):
    """What the loop reads and advances on a trainer."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    config: TrainConfig
    dp: SingleProcess | DataParallel
    steps: int
    optimizer_steps: int
    skipped_steps: int


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
    trainer: Trainable, batch: Rollouts, minibatches: Sequence[Tensor] | None = None
) -> Assignment:
    """Steps 1 to 3 of the module docstring for ``batch`` (the whole batch, on every rank)."""
    if len(batch) == 0:
        raise ValueError(f"{type(trainer).__name__}.step: empty batch")
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

    ``work.batch`` must carry what ``micro_loss`` reads (old log-probs, advantages, …). Counts the call in ``trainer.steps`` and applied / skipped updates in
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
            if _minibatch(trainer, work.batch.select(rows), normalizer, micro_loss, metrics):
                last_lr = lr
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


def _minibatch(
    trainer: Trainable,
    mini: Rollouts,
    normalizer: Tensor,
    micro_loss: MicroLoss,
    metrics: StepMetrics,
) -> bool:
    """Accumulate one mini-batch's gradient, then apply it (True) or skip it (False)."""
    device = next(trainer.model.parameters()).device
    finite = torch.ones((), dtype=torch.bool, device=device)
    pairs, _ = micro_batch_pairs(mini, trainer.config, trainer.dp)  # any order: a sum
    for micro, real in pairs:
        micro = micro.trim()
        loss, loss_metrics = micro_loss(micro, normalizer)
        if not real:  # a padding micro-batch: FSDP's collectives run, nothing is added
            loss = loss * 0.0
        if loss.requires_grad:
            loss.backward()
        if real:
            metrics.add_micro_batch(loss, loss_metrics, tokens=micro.response_mask.sum())
            finite &= torch.isfinite(loss.detach())
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
        metrics.commit(grad_norm)
    else:
        trainer.skipped_steps += 1
        metrics.discard()
    return ok


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
