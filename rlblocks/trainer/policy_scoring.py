"""How a ``PolicyTrainer`` scores responses: log π_θ (and the entropy) with or without a
gradient, and log π_ref from the reference module or, with LoRA, from the policy with its
adapters disabled. Functions of the trainer, kept here so that ``rlblocks.trainer.policy``
reads as the update itself; ``policy`` imports them, never the other way.

Every score is micro-batched like a training step (``rlblocks.trainer.batches``), each
micro-batch trimmed of unused padding, on the trainer's device, in the model's precision; the
trainer's public methods cast to float32 and move the result to the rows' device.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from rlblocks.rollouts import Rollouts
from rlblocks.trainer.batches import scored_in_pieces
from rlblocks.trainer.forward import score_responses


def score(
    trainer: Any, model: nn.Module, rollouts: Rollouts, *, entropy: bool, replay: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``(b t)`` log-probs of one micro-batch under ``model`` (with the gradient when grad is
    on) and, with ``entropy``, the ``(b t)`` entropy, else None; logits divided by
    ``config.temperature``, ``replay``: of the distribution the engine sampled from
    (``rlblocks.trainer.forward.score_responses``)."""
    c = trainer.config
    return score_responses(
        model,
        rollouts,
        temperature=c.temperature,
        bf16=bool(c.bf16),
        chunk_size=c.logprob_chunk_size,
        entropy=entropy,
        packing=c.packing,
        sequence=trainer.dp.sequence,
        replay=replay,
    )


@torch.no_grad()
def score_no_grad(
    trainer: Any,
    model: nn.Module,
    rollouts: Rollouts,
    *,
    entropy: bool = False,
    replay: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`score` of the whole batch without a gradient, micro-batched, each micro-batch trimmed
    of unused padding; ``replay``: of the distribution the engine sampled from (the policy's,
    never π_ref's). ``(b t)`` on the trainer's device."""
    rollouts = rollouts.to(trainer.device)
    b, t = rollouts.response_ids.shape
    if b == 0 and trainer.dp.size == 1:
        empty = torch.zeros(b, t, device=trainer.device)
        return empty, empty if entropy else None
    lp, ent = scored_in_pieces(
        partial(score, trainer, model, entropy=entropy, replay=replay),
        rollouts,
        trainer.config,
        trainer.dp,
    )
    assert lp is not None  # score always gives log-probs (only the entropy may be None)
    return lp, ent


def ref_scores(trainer: Any, rollouts: Rollouts) -> Tensor:
    """``(b t)`` log π_ref, no gradient: the policy with its adapters disabled (LoRA's
    reference), else the reference module; ``ValueError`` when the trainer has neither."""
    if trainer._adapter_reference:
        with trainer.model.disable_adapter():
            return score_no_grad(trainer, trainer.model, rollouts)[0]
    if trainer.reference is None:
        raise ValueError(
            "PolicyTrainer.ref_logprobs: the trainer has no reference model "
            "(reference=None); build it with reference='copy' or a module"
        )
    return score_no_grad(trainer, trainer.reference, rollouts)[0]


def reference_tensors(trainer: Any) -> list[tuple[str, Tensor]]:
    """What ``ref_logprobs`` comes from, by name: the reference model's state, or the frozen
    base weights of a LoRA policy (its checkpoint fingerprint, `rlblocks.trainer.checkpoint`)."""
    if trainer.reference is not None:
        return list(trainer.reference.state_dict().items())
    frozen = trainer.model.named_parameters() if trainer._adapter_reference else ()
    return [(name, p) for name, p in frozen if not p.requires_grad]
