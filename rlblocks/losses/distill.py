"""On-policy distillation: the per-token reverse KL from a student to its teacher.

The student π_θ samples a response y; the teacher π_T scores every sampled token. At each
position the reverse KL of the next-token distributions is

    KL(π_θ ‖ π_T)(· | x, y_<t) = E_{v ∼ π_θ(· | x, y_<t)} [log π_θ(v | …) − log π_T(v | …)],

and the sampled token gives its one-sample estimate, k1 of `rlblocks.losses.kl`:

    d_t = log π_θ(y_t | x, y_<t) − log π_T(y_t | x, y_<t).

Reverse KL is mode seeking: the student is pulled towards what the teacher finds likely
*where the student itself goes*, so it learns to recover from its own mistakes, which training
on the teacher's samples (forward KL, SFT on teacher outputs) never shows it (Agarwal et al.
2024, GKD, arXiv 2306.13649, sec. 3; Gu et al. 2024, MiniLLM, arXiv 2306.08543).

Minimizing it is a reinforcement-learning problem with the per-token reward −d_t: its gradient,
with the samples drawn from π_θ, is E[Σ_t d_t ∇ log π_θ(y_t)] taking each token's own term
(the future terms dropped, as in GKD's and Qwen3's per-token objective; Lu & Thinking Machines
2025, "On-Policy Distillation", use the same per-token advantage, discount 0). So rlblocks
trains it as RL: `rlblocks.advantage.teacher_kl` turns d into per-token advantages −β·d, which
add to a task reward's advantages, and any policy loss (the PPO clip, importance sampling)
follows them. :func:`reverse_kl` is the quantity itself, per token, for metrics and tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.base.masked import masked_mean
from rlblocks.losses.kl import k1


def reverse_kl(
    student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, /
) -> tuple[Tensor, dict[str, Tensor]]:
    """d_t = log π_θ(y_t) − log π_T(y_t) per response token (module docstring), and metrics.

    Shapes: all ``(b t)``; ``mask`` bool. Returns ``d`` ``(b t)`` float32 (float64 for float64
    inputs), 0 where ``mask`` is False, not detached; metrics (detached): ``distill/reverse_kl``,
    the mean of d over valid tokens (its expectation is the mean per-token reverse KL, ≥ 0; a
    single batch can be below 0), and ``distill/teacher_logprob``, the mean teacher log-prob of
    the sampled tokens. Zero exactly when the two log-probs agree.
    """
    d = k1(student_logprobs, teacher_logprobs)
    d = torch.where(mask, d, torch.zeros((), dtype=d.dtype, device=d.device))
    metrics = {
        "distill/reverse_kl": masked_mean(d.detach(), mask),
        "distill/teacher_logprob": masked_mean(teacher_logprobs.detach().to(d.dtype), mask),
    }
    return d, metrics


__all__ = ["reverse_kl"]
