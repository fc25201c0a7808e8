"""Reducing a per-token loss ``(b t)`` to the scalar that is back-propagated.

Every mode is a masked sum divided by a normalizer: ``mode(loss, mask, normalizer)``. The
normalizer is explicit, and computed once over the whole mini-batch by
``mode.normalizer(mask_of_the_minibatch)``, because that is what makes the gradient independent
of how the mini-batch is cut up:

- **Gradient accumulation.** Split a mini-batch into micro-batches, call
  ``aggregate(loss_k, mask_k, mode=m, normalizer=n)`` on each with the *same* mini-batch ``n``,
  and ``.backward()`` each result: the accumulated gradient equals that of one pass over the
  mini-batch, because Σ_k (Σ_{k's tokens} ℓ) / n = (Σ_all ℓ) / n. Normalizing each
  micro-batch by its own token count and averaging instead weights a token of a short
  micro-batch more than one of a long micro-batch: the gradient changes with the split.
- **Data parallelism.** Each rank computes its local normalizer and the ranks all-reduce it
  with a sum, so every rank divides by the global count. A DP wrapper that *averages*
  gradients over ranks (DDP, FSDP) then divides by the world size once more: multiply the
  aggregated loss by the world size to undo it.

Modes are small frozen dataclasses (hashable, comparable, readable when printed); pick one
by passing it in. :data:`AGGREGATIONS` maps config-file names to modes and is meant for the edge
of a program (a CLI, a YAML loader), not for library code.

A "sequence" below is a row with at least one valid token: fully masked rows (filtered
samples, padding rows) are not counted by the seq-mean modes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlblocks.base.masked import masked_sum
from rlblocks.base.registry import Registry
from rlblocks.interfaces import Aggregation


def _divide(total: Tensor, normalizer: Tensor | float) -> Tensor:
    # An empty mini-batch has normalizer 0 and a total of 0: return 0, not NaN.
    normalizer = torch.as_tensor(normalizer, dtype=total.dtype, device=total.device)
    return total / torch.where(normalizer > 0, normalizer, torch.ones_like(normalizer))


def _n_sequences(mask: Tensor) -> Tensor:
    return mask.any(dim=-1).sum().float()


@dataclass(frozen=True)
class TokenMean:
    """Σ_i Σ_t ℓ_it / N_tokens: every valid token of the mini-batch weighs the same.

    DAPO's token-level loss (Yu et al. 2025, arXiv 2503.14476, sec. 3.3): long responses are not
    down-weighted per token as in the per-sequence mean of GRPO.
    """

    def normalizer(self, mask: Tensor) -> Tensor:
        """The number of valid tokens in ``mask``."""
        return mask.sum().float()

    def __call__(self, loss: Tensor, mask: Tensor, normalizer: Tensor | float) -> Tensor:
        return _divide(masked_sum(loss, mask), normalizer)


@dataclass(frozen=True)
class SeqMeanTokenSum:
    """Σ_i Σ_t ℓ_it / N_seqs: a sum over each sequence's tokens, averaged over sequences.

    The per-sequence sum of REINFORCE-style objectives (Williams 1992); the gradient scale
    grows with response length.
    """

    def normalizer(self, mask: Tensor) -> Tensor:
        """The number of sequences with at least one valid token."""
        return _n_sequences(mask)

    def __call__(self, loss: Tensor, mask: Tensor, normalizer: Tensor | float) -> Tensor:
        return _divide(masked_sum(loss, mask), normalizer)


@dataclass(frozen=True)
class SeqMeanTokenMean:
    """Σ_i (Σ_t ℓ_it / L_i) / N_seqs: a mean over each sequence's tokens, then over sequences.

    The original GRPO objective (Shao et al. 2024, arXiv 2402.03300, eq. 3, the 1/|o_i| and
    1/G factors). L_i is row i's own number of valid tokens, which is known inside any
    micro-batch; only N_seqs needs the mini-batch normalizer.
    """

    def normalizer(self, mask: Tensor) -> Tensor:
        """The number of sequences with at least one valid token (each row's sum is divided by
        its own length first)."""
        return _n_sequences(mask)

    def __call__(self, loss: Tensor, mask: Tensor, normalizer: Tensor | float) -> Tensor:
        lengths = mask.sum(dim=-1).clamp(min=1)
        return _divide((masked_sum(loss, mask, dim=-1) / lengths).sum(), normalizer)


@dataclass(frozen=True)
class SeqMeanTokenSumNorm:
    """Σ_i Σ_t ℓ_it / (N_seqs · C) with a constant C: Dr. GRPO's length-unbiased loss.

    Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv 2503.20783, sec. 3.1):
    dividing by a constant instead of |o_i| removes GRPO's bias towards long wrong answers. ``max_tokens`` is C, usually the generation budget (max response length). With
    ``None``, C is the padded response length ``t`` of the mask given to :meth:`normalizer`;
    pass it explicitly when micro-batches or ranks pad to different lengths.
    """

    max_tokens: float | None = None

    def normalizer(self, mask: Tensor) -> Tensor:
        """Sequences with a valid token × ``max_tokens`` (the mask's width when None)."""
        constant = mask.shape[-1] if self.max_tokens is None else self.max_tokens
        return _n_sequences(mask) * float(constant)

    def __call__(self, loss: Tensor, mask: Tensor, normalizer: Tensor | float) -> Tensor:
        return _divide(masked_sum(loss, mask), normalizer)


token_mean = TokenMean()
seq_mean_token_sum = SeqMeanTokenSum()
seq_mean_token_mean = SeqMeanTokenMean()
seq_mean_token_sum_norm = SeqMeanTokenSumNorm()

AGGREGATIONS: Registry[Aggregation] = Registry("aggregation", key="trainer.aggregation")
"""Config-file names (verl's spelling) to modes. For the edge of a program only."""
AGGREGATIONS.register("token-mean", token_mean)
AGGREGATIONS.register("seq-mean-token-sum", seq_mean_token_sum)
AGGREGATIONS.register("seq-mean-token-mean", seq_mean_token_mean)
AGGREGATIONS.register("seq-mean-token-sum-norm", seq_mean_token_sum_norm)


def aggregate(
    loss: Tensor,
    mask: Tensor,
    /,
    *,
    mode: Aggregation = token_mean,
    normalizer: Tensor | float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar: masked sum / mini-batch normalizer.

    ``normalizer=None`` means "this call sees the whole mini-batch" and uses
    ``mode.normalizer(mask)``. For gradient accumulation pass the normalizer of the whole
    mini-batch to every micro-batch call (and, with data parallelism, its sum over ranks);
    see the module docstring for why.

    Shapes: ``loss`` ``(b t)`` float, ``mask`` ``(b t)`` bool, ``normalizer`` a scalar.
    Returns a scalar with the loss's dtype; the gradient flows through ``loss``. A mini-batch
    with nothing valid aggregates to 0.
    """
    if normalizer is None:
        normalizer = mode.normalizer(mask)
    return mode(loss, mask, normalizer)
