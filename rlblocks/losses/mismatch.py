"""Rollout-versus-trainer mismatch: how far the engine's sampling log-probs are from the
trainer's, and truncated importance sampling (TIS) to correct for it.

The engine samples y ~ π_rollout; the trainer computes π_old(y) with its own kernels (another
dtype, another attention implementation, vLLM's fused kernels, stale weights if a sync was
missed). The update assumes samples from π_old, so the mismatch biases the gradient.
Per sampled token, with d = log π_old(y) − log π_rollout(y):

- ``mismatch/abs_mean``, ``mismatch/abs_max``: mean and largest |d| over valid tokens;
- ``mismatch/kl``: the k3 estimate of KL(π_rollout ‖ π_old) = E_y~π_rollout[e^d − 1 − d]
  (unbiased, never negative; Schulman 2020, "Approximating KL divergence");
- ``mismatch/ratio_mean``: the mean importance ratio e^d = π_old(y) / π_rollout(y) (1 in
  expectation over y ~ π_rollout when nothing is truncated);
- ``mismatch/outside``: the share of tokens whose ratio is outside [1/2, 2], the band of the
  token masking corrections (`rlblocks.losses.offpolicy`).

The corrections that weight the loss by these ratios (truncated importance sampling, token and
sequence masking) are in `rlblocks.losses.offpolicy`.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The ratio band whose outside ``mismatch/outside`` counts: IcePop's default bounds.
BAND = (0.5, 2.0)


def mismatch_sums(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``(count, Σ|d|, Σ k3, Σ e^d, tokens outside BAND, max |d|)`` as float64, d = logprobs −
    rollout_logprobs (b t).

    Sums add up over micro-batches and data-parallel ranks; the last entry combines by max.
    """
    d = (logprobs.detach().double() - rollout_logprobs.detach().double())[mask]
    if d.numel() == 0:
        return torch.zeros(6, dtype=torch.float64, device=logprobs.device)
    k3 = torch.expm1(d) - d
    ratio = d.exp()
    outside = (ratio < BAND[0]) | (ratio > BAND[1])
    count = torch.tensor(float(d.numel()), dtype=torch.float64, device=d.device)
    return torch.stack(
        [count, d.abs().sum(), k3.sum(), ratio.sum(), outside.sum().double(), d.abs().max()]
    )


def mismatch_metrics(sums: Tensor) -> dict[str, float]:
    """The metrics from :func:`mismatch_sums` (NaN with no valid token)."""
    count, abs_sum, k3_sum, ratio_sum, outside, abs_max = sums.tolist()
    names = ("abs_mean", "abs_max", "kl", "ratio_mean", "outside")
    if count == 0:
        return {f"mismatch/{k}": float("nan") for k in names}
    values = (abs_sum / count, abs_max, k3_sum / count, ratio_sum / count, outside / count)
    return {f"mismatch/{k}": v for k, v in zip(names, values, strict=True)}


def rollout_mismatch(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Mean and max |log π_old − log π_rollout|, the k3 KL estimate, the mean ratio and the share
    of ratios outside [1/2, 2], over valid tokens."""
    return mismatch_metrics(mismatch_sums(logprobs, rollout_logprobs, mask))
