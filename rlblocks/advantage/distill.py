"""Per-token advantages of on-policy distillation: minus the reverse KL to a teacher."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.interfaces import Advantages
from rlblocks.losses.distill import reverse_kl as reverse_kl_per_token


@torch.no_grad()
def teacher_kl(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    /,
    *,
    kl_coef: float = 1.0,
) -> Advantages:
    """A_t = −β · (log π_θ(y_t) − log π_T(y_t)) on every valid response token, β = ``kl_coef``.

    (Not `rlblocks.losses.reverse_kl`, the per-token estimate d_t and its metrics, which this
    turns into advantages.)

    The per-token reward of on-policy distillation (`rlblocks.losses.distill`), used as its own
    advantage with discount 0: a token the teacher finds likelier than the student did is pushed
    up, one it finds less likely is pushed down (Lu & Thinking Machines 2025, "On-Policy
    Distillation"; GKD, Agarwal et al. 2024, arXiv 2306.13649). With a policy loss ``ℓ = −A ·
    ratio`` the update's gradient at π_old is E[Σ_t d_t ∇ log π_θ(y_t)] · β, the per-token
    reverse-KL gradient. It is zero where student and teacher agree, so it adds to a task
    reward's advantages (``grpo(...).advantages + teacher_kl(...).advantages``) without moving
    their scale where the student already matches.

    ``student_logprobs`` are the sampling policy's (π_old) log-probs; ``teacher_logprobs`` from
    ``Teacher.logprobs``; all ``(b t)``, ``mask`` bool. Returns ``Advantages`` with
    ``advantages`` = ``returns`` = A, ``(b t)`` float32, zero off ``mask``, detached.
    """
    if kl_coef < 0:
        raise ValueError(f"teacher_kl: kl_coef={kl_coef} is negative; use kl_coef >= 0")
    d, _ = reverse_kl_per_token(student_logprobs.float(), teacher_logprobs.float(), mask)
    advantages = (-kl_coef * d).float()
    return Advantages(advantages, advantages.clone())


__all__ = ["teacher_kl"]
