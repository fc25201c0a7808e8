"""What a policy loss receives in an update, and the loss of one micro-batch.

``PolicyTrainer.step`` and ``forward_backward`` share both halves:

- :func:`prepare`, before any gradient: π_old (given, or scored now, or marked to be taken from
  the update's own forward, ``rlblocks.trainer.pi_old``) and π_ref when the loss takes it.
- :func:`micro_loss`, the :data:`~rlblocks.trainer.update.MicroLoss` of the shared update loop:
  forward, per-token ``loss_fn``, ``aggregate`` with the normalizer it is given.

The optional inputs a loss takes are read from its signature (``rlblocks.losses.inputs``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from rlblocks.interfaces import Aggregation, PolicyLoss
from rlblocks.losses.aggregate import aggregate
from rlblocks.losses.inputs import LossInputs
from rlblocks.masked import masked_mean
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.pi_old import ROW, numbered

#: ``score(rollouts, entropy=...) -> (logprobs, entropy or None)``, each ``(b t)``, with gradient.
Score = Callable[..., tuple[Tensor, Tensor | None]]


def prepare(
    batch: Rollouts,
    wants: LossInputs,
    *,
    in_update: bool,
    score_old: Callable[[Rollouts], Tensor],
    score_ref: Callable[[Rollouts], Tensor] | None,
) -> Rollouts:
    """``batch`` (a rank's rows) with ``old_logprobs`` (and ``ref_logprobs``) filled: taken from
    the rollouts when there, else scored now by ``score_old`` / ``score_ref`` (no grad, before
    any update; ``score_ref`` None: the trainer has no reference). ``in_update``: π_old comes
    from the update's own forward instead; the rows get their index (an extra) so that it can
    be put back in place."""
    if "rollout_logprobs" in wants.required and batch.rollout_logprobs is None:
        raise ValueError("the loss needs rollout_logprobs but the rollouts carry none")
    if in_update:
        batch = numbered(batch)
    else:
        old = batch.old_logprobs
        if old is None:
            old = score_old(batch)
        batch = batch.replace(old_logprobs=old.detach())
    if "ref_logprobs" in wants.accepted and batch.ref_logprobs is None:
        if score_ref is not None:
            batch = batch.replace(ref_logprobs=score_ref(batch).detach())
        elif "ref_logprobs" in wants.required:
            raise ValueError("the loss needs ref_logprobs but the trainer has no reference")
    return batch


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
    per_token, metrics = loss_fn(lp, micro.old_logprobs, micro.advantages, mask, **kwargs)
    loss = aggregate(per_token, mask, mode=aggregation, normalizer=normalizer)
    if entropy is not None:
        metrics = {**metrics, "entropy": masked_mean(entropy.detach(), mask)}
    return loss, metrics
