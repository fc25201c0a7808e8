"""What a policy loss receives in an update, and the loss of one micro-batch.

``PolicyTrainer.step`` and ``forward_backward`` share all of it, through
:func:`prepare_update`:

- :func:`prepare_update`, before any gradient: π_old (given, or scored now, or marked to be
  taken from the update's own forward, ``rlblocks.trainer.pi_old``) and π_ref when the loss
  takes it.
- :func:`micro_loss`, the :data:`~rlblocks.trainer.update.MicroLoss` of the shared update loop:
  forward, per-token ``loss_fn``, ``aggregate`` with the normalizer it is given.

The optional inputs a loss takes are read from its signature (``rlblocks.losses.inputs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import Tensor

from rlblocks.base.masked import masked_mean
from rlblocks.interfaces import Aggregation, PolicyLoss
from rlblocks.losses.aggregate import aggregate
from rlblocks.losses.inputs import LossInputs, loss_inputs
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.config import TrainConfig
from rlblocks.trainer.pi_old import ROW, from_update, gathered, mismatch, numbered
from rlblocks.trainer.update import Assignment, MicroLoss

#: ``score(rollouts, entropy=...) -> (logprobs, entropy or None)``, each ``(b t)``, with gradient.
Score = Callable[..., tuple[Tensor, Tensor | None]]


@dataclass
class PreparedUpdate:
    """A policy update ready for the shared loop (``rlblocks.trainer.update``)."""

    work: Assignment
    """This rank's rows, with π_old (or their row numbers) and π_ref ready."""
    loss: MicroLoss
    """The loss of one micro-batch."""
    seen: list[tuple[Tensor, Tensor]] | None
    """π_old as the update's own forward gives it (rows, log-probs), when it comes from there."""

    def mismatch(self, dp: Any) -> dict[str, float]:
        """The mismatch metrics of the batch (``rlblocks.trainer.pi_old.mismatch``), with π_old
        as the forward gave it when it came from there; call after the update."""
        batch = self.work.batch if self.seen is None else gathered(self.work.batch, self.seen)
        return mismatch(dp, batch.select(self.work.owned))


def prepare_update(
    work: Assignment,
    loss_fn: PolicyLoss,
    *,
    config: TrainConfig,
    score: Score,
    score_old: Callable[[Rollouts], Tensor],
    score_ref: Callable[[Rollouts], Tensor] | None,
) -> PreparedUpdate:
    """``work`` with π_old and π_ref ready and its :func:`micro_loss`. π_old
    comes from the update's own forward when none is given and the update is one optimizer step
    over all of the rank's rows (``rlblocks.trainer.pi_old.from_update``). ``score``: with
    gradient, for the loss; ``score_old`` / ``score_ref``: no grad, before the update."""
    wants = loss_inputs(loss_fn)
    if "rollout_logprobs" in wants.required and work.batch.rollout_logprobs is None:
        raise ValueError(
            f"PolicyTrainer.step: the loss {loss_name(loss_fn)} needs rollout_logprobs (the "
            "engine's log-probs) but the rollouts carry none; generate with an engine that "
            "records them, or use a loss without them"
        )
    batch = work.batch
    # π_old: taken from the rollouts when there, else scored now (no grad, before any update),
    # or, in_update, taken from the update's own forward: the rows get their index (an extra)
    # so that it can be put back in place
    in_update = batch.old_logprobs is None and from_update(work)
    if in_update:
        batch = numbered(batch)
    else:
        old = batch.old_logprobs
        batch = batch.replace(old_logprobs=(score_old(batch) if old is None else old).detach())
    if "ref_logprobs" in wants.accepted and batch.ref_logprobs is None:
        if score_ref is not None:
            batch = batch.replace(ref_logprobs=score_ref(batch).detach())
        elif "ref_logprobs" in wants.required:
            raise ValueError(
                "PolicyTrainer.step: the loss needs ref_logprobs but the trainer has no reference; "
                "build the trainer with reference='copy' or pass rollouts with ref_logprobs"
            )
    seen: list[tuple[Tensor, Tensor]] | None = [] if in_update else None
    loss = partial(
        micro_loss,
        score=score,
        loss_fn=loss_fn,
        wants=wants,
        aggregation=config.aggregation,
        log_entropy=config.log_entropy,
        seen=seen,
    )
    return PreparedUpdate(dataclasses.replace(work, batch=batch), loss, seen)


def loss_name(loss_fn: Callable[..., Any]) -> str:
    """How an error names a loss: ``MaskedIS(clipped_surrogate)``, ``cispo``, ``my_loss``."""
    inner = getattr(loss_fn, "loss_fn", None)
    base = getattr(loss_fn, "func", loss_fn)  # a functools.partial's function
    name = getattr(base, "__name__", None) or type(base).__name__
    return f"{name}({loss_name(inner)})" if inner is not None else name


def micro_loss(
    micro: Rollouts,
    normalizer: Tensor,
    *,
    score: Score,
    loss_fn: PolicyLoss,
    wants: LossInputs,
    aggregation: Aggregation,
    log_entropy: bool,
    seen: list[tuple[Tensor, Tensor]] | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch: forward (``score``), per-token ``loss_fn``, ``aggregate`` with the
    mini-batch ``normalizer``; the loss metrics, and the mean entropy of its valid tokens when
    the loss takes it or ``log_entropy`` asks for it. ``seen`` (π_old from this forward): each
    micro-batch's row indices and detached log-probs are appended to it."""
    in_loss = "entropy" in wants.accepted
    lp, entropy = score(micro, entropy=in_loss or log_entropy)
    if seen is not None:
        micro = micro.replace(old_logprobs=lp.detach())
        seen.append((micro.extras[ROW], lp.detach()))
    if entropy is not None and not in_loss:
        entropy = entropy.detach()  # only a metric: no gradient through it
    inputs = {
        "entropy": entropy,
        "rollout_logprobs": micro.rollout_logprobs,
        "ref_logprobs": micro.ref_logprobs,
    }
    kwargs = {k: v for k, v in inputs.items() if k in wants.accepted and v is not None}
    mask = micro.response_mask
    # π_old: set by prepare_update, or above from this forward; the advantages: set by the trainer
    assert micro.old_logprobs is not None and micro.advantages is not None
    per_token, metrics = loss_fn(lp, micro.old_logprobs, micro.advantages, mask, **kwargs)
    loss = aggregate(per_token, mask, mode=aggregation, normalizer=normalizer)
    if entropy is not None:
        metrics = {**metrics, "entropy": masked_mean(entropy.detach(), mask)}
    return loss, metrics
