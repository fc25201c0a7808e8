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
    grad_norm = total_norm([p.grad for p in params]).to(finite.device)
    applied = bool(finite & torch.isfinite(grad_norm))  # the one host sync per mini-batch
    if applied:
        if max_grad_norm is not None:
            clip(params, max_grad_norm, grad_norm)
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


def total_norm(grads: list[Tensor]) -> Tensor:
    """The 2-norm of all ``grads`` together, whole over the ranks that shard them.

    Sharded gradients (DTensors: FSDP's ``Shard(0)`` over the data-parallel mesh, tensor
    parallelism's over a 2-D one) are normed per (mesh, placements) group, each group's norm
    made whole over its mesh (a collective, in the same order on every rank: parameter
    order), and the groups combined: ‖g‖ = sqrt(Σ_groups ‖g_group‖²). Plain tensors are whole.
    """
    groups: dict[object, list[Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for part in groups.values():
        norm = torch.nn.utils.get_total_norm(part)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def clip(params: list[Tensor], max_norm: float, norm: Tensor) -> None:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as
    ``torch.nn.utils.clip_grads_with_norm_`` does, on each rank's own part of sharded ones
    (one scalar for all: no collective, and gradients on different meshes are fine)."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for p in params:
        assert p.grad is not None  # the caller passes the parameters that have a gradient
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grads.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), part in grads.items():
        torch._foreach_mul_(part, coef.to(device))
