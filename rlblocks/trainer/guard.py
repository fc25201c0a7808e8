"""The NaN/inf guard around an optimizer step, shared by the policy and the critic trainers.

A mini-batch whose loss or total gradient norm is not finite must not touch the model: the
gradients are dropped, and the weights, the optimizer state (AdamW's moments) and the learning
rate schedule stay exactly as they were. Deciding it costs one host sync per mini-batch.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def guarded_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    finite: Tensor,
    max_grad_norm: float | None,
    owner: str,
) -> tuple[bool, Tensor]:
    """Clip and apply the accumulated gradients, or skip them all; then zero the gradients.

    ``finite``: a bool scalar tensor, False when some micro-batch loss was not finite.
    Returns ``(applied, grad_norm)`` with the total gradient norm before clipping. A skipped
    step raises a ``RuntimeWarning`` naming ``owner``.
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(grad_norm, DTensor):  # FSDP shards: the norm over all ranks (a collective)
        grad_norm = grad_norm.full_tensor()
    grad_norm = grad_norm.to(finite.device)
    applied = bool(finite & torch.isfinite(grad_norm))  # the one host sync per mini-batch
    if applied:
        if max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, grad_norm)
        optimizer.step()
        scheduler.step()
    else:
        warnings.warn(
            f"{owner}: non-finite loss or gradient norm ({float(grad_norm)}); optimizer step "
            "skipped (weights, optimizer state and schedule unchanged)",
            RuntimeWarning,
            stacklevel=4,
        )
    optimizer.zero_grad(set_to_none=True)
    return applied, grad_norm
