"""Sampling replay: the kept set of top-k / top-p sampling, recomputed from logits.

An engine that samples with top-k or top-p draws from the tempered distribution renormalized
over a kept set K of tokens, π_K(y) = softmax(z / T)[y] / Σ_{j∈K} softmax(z / T)[j]. A trainer
that scores log softmax(z / T)[y] instead is off by the log of the kept mass,
log π_K(y) − log π(y) = −log Σ_{j∈K} π(j) ≥ 0, at every truncated step. Recording the
sampler's rule (temperature, top_k, top_p) on the rollouts lets the trainer rebuild K from its
own logits and score log π_K(y) = z_y − logsumexp_{j∈K} z_j (prime-rl's and vLLM's
``processed_logprobs``: the distribution the engine sampled from).

The rule is Hugging Face ``generate``'s, in its order (temperature, ``TopKLogitsWarper``,
``TopPLogitsWarper``), which vLLM's ``apply_top_k_top_p`` shares:

- top-k keeps every token whose tempered logit is at least the k-th largest (ties at the k-th
  value are kept); k = 0, or k ≥ v, keeps all;
- top-p then sorts the top-k survivors ascending, takes the softmax's running sum and removes
  the tokens whose running sum is ≤ 1 − p (the threshold in float32, as both engines compare
  it), always keeping the most likely one; p = 1 keeps all.

Both engines compute the rule on float32 logits, so :func:`kept_tokens` does too. The sampled
token is always kept (``chosen``): the trainer's logits differ from the engine's by rounding
(cached vs uncached attention, another kernel), which can move a token at the edge of K out of
it, and its log-prob would then be −inf (prime-rl restores the label's logit for the same
reason). The rule is constant almost everywhere in the logits, so the gradient treats K as
fixed (as autograd of a masked ``log_softmax`` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: Columns of ``Rollouts.sampler``: what the engine's sampler did to each row.
SAMPLER_COLUMNS = ("temperature", "top_k", "top_p")


@dataclass(frozen=True)
class Truncation:
    """The top-k / top-p rule of each scored token (``n`` tokens): ``top_k`` ``(n)`` int64
    (0 = off) and ``top_p`` ``(n)`` float64 (1 = off). Built per row from ``Rollouts.sampler``
    and spread over the row's tokens (:meth:`of_rows`)."""

    top_k: Tensor
    top_p: Tensor

    @classmethod
    def of_rows(cls, sampler: Tensor, rows: Tensor) -> Truncation:
        """The rule of tokens whose rows are ``rows`` ``(n)`` (indices into ``sampler``'s
        ``(b 3)`` rows). Greedy rows (temperature 0) are scored untruncated."""
        sampler = sampler.to(rows.device)[rows]
        greedy = sampler[:, 0] == 0
        top_k = torch.where(greedy, 0, sampler[:, 1]).long()
        top_p = torch.where(greedy, 1.0, sampler[:, 2]).double()
        return cls(top_k, top_p)

    def __getitem__(self, part: slice | Tensor) -> Truncation:
        return Truncation(self.top_k[part], self.top_p[part])

    def active(self, vocab: int) -> Tensor:
        """``(n)`` bool: the tokens whose rule removes anything from a vocabulary of ``vocab``."""
        return ((self.top_k > 0) & (self.top_k < vocab)) | (self.top_p < 1)


def kept_tokens(
    logits: Tensor, top_k: Tensor, top_p: Tensor, *, chosen: Tensor | None = None
) -> Tensor:
    """``(n v)`` bool: the tokens top-k then top-p keep in each row of tempered ``logits``.

    ``logits`` ``(n v)``, any float dtype, already divided by the temperature (the rule is
    computed on their float32 cast, as the engines do); ``top_k`` ``(n)`` int (0 = off),
    ``top_p`` ``(n)`` float (1 = off). ``chosen`` ``(n)`` int64: tokens kept whatever the rule
    says (the sampled ones; module docstring). Equal to Hugging Face's ``TopKLogitsWarper``
    then ``TopPLogitsWarper`` (``min_tokens_to_keep=1``) on float32 logits, row by row
    (tests/losses/test_truncation.py checks it bit for bit). Not differentiable (a mask).
    """
    z = logits.detach().float()
    n, v = z.shape
    keep = torch.ones((n, v), dtype=torch.bool, device=z.device)
    top_k = top_k.to(z.device).long()
    by_k = (top_k > 0) & (top_k < v)
    if bool(by_k.any()):
        k = torch.where(by_k, top_k, 1)
        kth = torch.topk(z, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        keep &= ~(by_k[:, None] & (z < kth))
    top_p = top_p.to(z.device)
    by_p = top_p < 1
    if bool(by_p.any()):
        rows = by_p.nonzero()[:, 0]
        # Temporaries of ~24 bytes a logit (sorted values, int64 order, running sum), each freed
        # as soon as it is used: the peak of replaying top-p on a chunk.
        ascending, order = torch.sort(z[rows].masked_fill(~keep[rows], -float("inf")))
        running = ascending.softmax(dim=-1)
        del ascending
        running.cumsum_(dim=-1)
        threshold = (1 - top_p[rows].double()).float()[:, None]
        removed = running <= threshold
        removed[:, -1] = False  # the most likely token stays
        keep[rows] &= ~removed.scatter(1, order, removed)
    if chosen is not None:
        keep.scatter_(1, chosen.to(z.device)[:, None], True)
    return keep


def masked_logits(z: Tensor, keep: Tensor) -> Tensor:
    """``z`` with −inf outside ``keep``: logsumexp and softmax over the kept set."""
    return z.masked_fill(~keep, -float("inf"))


__all__ = ["SAMPLER_COLUMNS", "Truncation", "kept_tokens", "masked_logits"]
