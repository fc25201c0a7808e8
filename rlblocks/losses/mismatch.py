"""Rollout-versus-trainer mismatch: how far the engine's sampling log-probs are from the
trainer's, and truncated importance sampling (TIS) to correct for it.

The engine samples y ~ π_rollout; the trainer computes π_old(y) with its own kernels (another
dtype, another attention implementation, vLLM's fused kernels, stale weights if a sync was
missed). The update assumes samples from π_old, so the mismatch biases the gradient.
Per sampled token, with d = log π_old(y) − log π_rollout(y):

- ``mismatch/abs_mean``, ``mismatch/abs_max``: mean and largest |d| over valid tokens;
- ``mismatch/kl``: the k3 estimate of KL(π_rollout ‖ π_old) = E_y~π_rollout[e^d − 1 − d]
  (unbiased, never negative; Schulman 2020, "Approximating KL divergence").

TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training")
weights each token's loss by w = min(π_old(y) / π_rollout(y), C), detached: an importance
weight for the sampling mismatch, truncated at C to bound its variance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlblocks.interfaces import PolicyLoss
from rlblocks.losses.inputs import forwarding_signature, loss_inputs


def mismatch_sums(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``(count, Σ|d|, Σ k3, max |d|)`` as float64, d = logprobs − rollout_logprobs (b t).

    Sums add up over micro-batches and data-parallel ranks; the last entry combines by max.
    """
    d = (logprobs.detach().double() - rollout_logprobs.detach().double())[mask]
    if d.numel() == 0:
        return torch.zeros(4, dtype=torch.float64, device=logprobs.device)
    k3 = torch.expm1(d) - d
    return torch.stack(
        [
            torch.tensor(float(d.numel()), dtype=torch.float64, device=d.device),
            d.abs().sum(),
            k3.sum(),
            d.abs().max(),
        ]
    )


def mismatch_metrics(sums: Tensor) -> dict[str, float]:
    """The metrics from :func:`mismatch_sums` (NaN with no valid token)."""
    count, abs_sum, k3_sum, abs_max = sums.tolist()
    if count == 0:
        return {k: float("nan") for k in ("mismatch/abs_mean", "mismatch/abs_max", "mismatch/kl")}
    return {
        "mismatch/abs_mean": abs_sum / count,
        "mismatch/abs_max": abs_max,
        "mismatch/kl": k3_sum / count,
    }


def rollout_mismatch(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Mean and max |log π_old − log π_rollout| and the k3 KL estimate over valid tokens."""
    return mismatch_metrics(mismatch_sums(logprobs, rollout_logprobs, mask))


@dataclass(frozen=True)
class TruncatedIS:
    """A policy loss whose per-token terms are weighted by min(π_old / π_rollout, ``cap``).

    ``TruncatedIS(partial(clipped_surrogate, clip=(0.2, 0.28)), cap=2.0)`` is a loss like any
    other; the trainer hands it ``rollout_logprobs`` (required) and it passes the inner loss
    ``is_weights`` plus whichever of ``ref_logprobs`` / ``entropy`` the inner loss takes (its
    signature names just those, so the trainer computes nothing else).
    Metrics add ``tis/weight_mean`` and ``tis/capped_frac`` (share of tokens at the cap).
    """

    loss_fn: PolicyLoss
    cap: float = 2.0

    def __post_init__(self) -> None:
        if self.cap <= 0:
            raise ValueError(f"TruncatedIS: cap must be > 0, got {self.cap}; pass a positive cap")
        # What the trainer reads: rollout_logprobs and what loss_fn takes, not all that
        # **kwargs could hold (else it would score the reference and the entropy for nothing).
        signature = forwarding_signature(self.loss_fn, required=["rollout_logprobs"])
        object.__setattr__(self, "__signature__", signature)

    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        /,
        *,
        rollout_logprobs: Tensor,
        **kwargs: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        ratio = torch.exp(old_logprobs.detach().float() - rollout_logprobs.detach().float())
        weights = torch.where(mask, ratio.clamp(max=self.cap), torch.ones_like(ratio))
        accepted = loss_inputs(self.loss_fn).accepted
        passed = {k: v for k, v in kwargs.items() if k in accepted}
        if "rollout_logprobs" in accepted:
            passed["rollout_logprobs"] = rollout_logprobs
        loss, metrics = self.loss_fn(
            logprobs, old_logprobs, advantages, mask, is_weights=weights, **passed
        )
        valid = mask.sum().clamp(min=1)
        metrics = {
            **metrics,
            "tis/weight_mean": (weights * mask).sum() / valid,
            "tis/capped_frac": ((ratio >= self.cap) & mask).sum() / valid,
        }
        return loss, metrics
