"""Data parallelism for the trainers: FSDP2 sharding and the collectives a policy update needs.

A ``PolicyTrainer`` built inside a worker of a data-parallel group (``rlblocks.placement.Ray``
does it) is sharded with :func:`shard`: every decoder layer and then the whole model become
FSDP2 units (``torch.distributed.fsdp.fully_shard``), the optimizer is rebuilt on the sharded
parameters, and the trainer gets a :class:`DataParallel` that does three things:

- **One normalizer for the whole mini-batch.** Each rank holds part of every mini-batch; the
  aggregation normalizer (token count, sequence count, ...) is summed over the ranks, and the
  gradients are *summed* (not averaged) by FSDP's reduce-scatter. Rank r's loss is
  Σ_{its tokens} ℓ / n(M) with the global n(M), so the sum over ranks is the single-process loss
  of M and the gradient does not depend on the data-parallel size.
- **The same number of forward passes on every rank.** FSDP all-gathers each layer during the
  forward and reduce-scatters its gradient during the backward: a rank that ran one micro-batch
  less would leave the others waiting forever. :meth:`DataParallel.aligned` pads a rank's list
  of micro-batches to the largest count with zero-weight copies of its first row.
- **One decision for the NaN guard**, and metrics reduced over the ranks.

Gloo serves CPUs, NCCL GPUs; every collective has the process group's timeout, so a dead peer
ends in an error, not a hang.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class FSDP:
    """How a trainer is sharded inside a data-parallel worker group."""

    param_dtype: torch.dtype | None = None
    """Dtype of the all-gathered parameters used in forward/backward (``torch.bfloat16`` for
    mixed precision); the sharded master weights and the optimizer stay in their own dtype."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of the gradient reduce-scatter; None: ``param_dtype``'s (float32 advised)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU between uses."""
    reshard_after_forward: bool = True
    """Free the gathered parameters after each forward (ZeRO-3); False keeps them (ZeRO-2)."""


class DataParallel:
    """This process's place in the data-parallel group, and the few collectives a step needs."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # NCCL reduces only CUDA tensors, gloo (here) CPU ones.
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def all_sum(self, x: Tensor) -> Tensor:
        """Σ over ranks of ``x``: a new tensor on ``x``'s device, in ``x``'s dtype."""
        out = x.detach().to(self.device or x.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out.to(x.device)

    def all_max(self, value: float) -> float:
        """The largest ``value`` over the ranks (float64 holds every count exactly)."""
        x = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return float(x)

    def all_true(self, flag: Tensor) -> Tensor:
        """True on every rank iff ``flag`` is True on every rank (the NaN guard's decision)."""
        bad = self.all_sum((~flag).to(torch.int64).reshape(1))
        return (bad == 0).reshape(()).to(flag.device)

    def aligned(self, parts: Sequence[Any], *, filler: Any) -> list[tuple[Any, bool]]:
        """``parts`` padded to the longest list over the ranks with ``(filler, False)`` entries.

        Returns ``(part, real)`` pairs; a padded entry must be run (so that FSDP's collectives
        match) with its result thrown away and a loss weight of zero.
        """
        count = int(self.all_max(len(parts)))
        return [(p, True) for p in parts] + [(filler, False)] * (count - len(parts))


def shard(trainer: Any, dp: DataParallel, config: FSDP) -> None:
    """Shard ``trainer.model`` (and a separate ``trainer.reference``) with FSDP2 over ``dp``.

    Must run before the first update: the optimizer and the schedule are rebuilt on the sharded
    parameters. Every module whose class is named in the model's ``_no_split_modules``
    (Hugging Face's list of decoder-layer classes) becomes its own FSDP unit, then the root.
    """
    if getattr(trainer, "optimizer_steps", 0):
        raise RuntimeError("shard: the trainer has already taken optimizer steps")
    if getattr(trainer, "dp", None) is not None:
        raise RuntimeError("shard: the trainer is already sharded")
    from rlblocks.trainer.lora import is_peft_model

    if is_peft_model(trainer.model):
        raise NotImplementedError(
            "LoRA policies are not sharded with FSDP yet: give a LoRA policy a pool of one "
            "worker (it then trains unsharded), or fine-tune all weights with several workers"
        )
    _fully_shard(trainer.model, dp, config, trainable=True)
    if trainer.reference is not None:
        _fully_shard(trainer.reference, dp, config, trainable=False)
    trainer.dp = dp
    trainer.rebuild_optimizer()


def _fully_shard(model: nn.Module, dp: DataParallel, config: FSDP, *, trainable: bool) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )

    device = next(model.parameters()).device
    mesh = DeviceMesh.from_group(dp.group or dist.group.WORLD, device_type=device.type)
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": config.reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype
        ),
    }
    if config.cpu_offload:
        # Pinned host memory speeds up copies to a GPU; without one it cannot be allocated.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    layers = set(_layer_classes(model))
    if not layers:
        raise ValueError(
            f"shard: {type(model).__name__} names no decoder-layer class in _no_split_modules; "
            "FSDP needs to know which modules to shard"
        )
    for module in list(model.modules()):
        if type(module).__name__ in layers:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    if trainable:
        # Sum, don't average, the gradients over ranks: each rank's loss already carries the
        # global normalizer. Gloo has no pre-multiplied sum, hence the forced plain sum. Both
        # settings are per FSDP unit.
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)


def _layer_classes(model: nn.Module) -> Iterator[str]:
    for module in model.modules():
        yield from getattr(module, "_no_split_modules", None) or ()


def gathered(
    named: Iterable[tuple[str, Tensor]], dp: DataParallel, *, bucket_bytes: int
) -> Iterator[tuple[str, Tensor]]:
    """``(name, whole tensor)`` for FSDP-sharded ``(name, DTensor)`` pairs, one collective per
    bucket of about ``bucket_bytes`` (whole-tensor bytes), in order. Every rank must iterate.

    FSDP2 shards dim 0 like ``torch.chunk``: rank r holds rows [r·c, min((r+1)·c, n)) with
    c = ⌈n / W⌉. Each rank zero-pads its rows of every tensor of the bucket to c, concatenates
    them into one flat buffer of the same size on all ranks, and one ``all_gather_single``
    brings every rank's buffer; tensor i is then rows [0, n) of the W pieces stacked. A tensor
    that appears under several names (tied weights) is gathered once. Tensors that are not
    sharded that way (plain tensors, other placements) are gathered alone with ``full_tensor``.
    """
    named = list(named)  # references only
    counts = Counter(id(value) for _, value in named)
    shared = {i for i, c in counts.items() if c > 1}  # kept after gathering; the rest is not
    pending: list[tuple[str, Tensor]] = []
    size = 0
    done: dict[int, Tensor] = {}
    for name, value in named:
        if id(value) in done or not _row_sharded(value, dp):
            yield from _gather_bucket(pending, dp, done, shared)
            pending, size = [], 0
            whole = done.get(id(value))
            if whole is None:
                whole = full_tensor(value.detach())
                if id(value) in shared:
                    done[id(value)] = whole
            yield name, whole
            continue
        nbytes = value.numel() * value.element_size()
        dtype_changes = pending and pending[0][1].dtype != value.dtype
        if pending and (size + nbytes > bucket_bytes or dtype_changes):
            yield from _gather_bucket(pending, dp, done, shared)
            pending, size = [], 0
        pending.append((name, value))
        size += nbytes
    yield from _gather_bucket(pending, dp, done, shared)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _row_sharded(x: Tensor, dp: DataParallel) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(x, DTensor)
        and x.dim() > 0
        and x.device_mesh.size() == dp.size
        and tuple(x.placements) == (Shard(0),)
    )


def _gather_bucket(
    bucket: list[tuple[str, Tensor]],
    dp: DataParallel,
    done: dict[int, Tensor],
    shared: set[int] | None = None,
) -> Iterator[tuple[str, Tensor]]:
    if not bucket:
        return
    shared = shared or set()
    world = dp.size
    pieces, layout = [], []
    for _, value in bucket:
        n, rest = value.shape[0], tuple(value.shape[1:])
        rows = -(-n // world)  # ⌈n / W⌉
        local = value.to_local().detach()
        piece = local.new_zeros((rows, *rest))
        piece[: local.shape[0]] = local
        pieces.append(piece.flatten())
        layout.append((n, rows, rest))
    send = torch.cat(pieces)
    device = dp.device or send.device
    received = send.new_empty(world * send.numel(), device=device)
    _all_gather(received, send.to(device), group=dp.group)
    received = received.view(world, send.numel())
    offset = 0
    for (name, value), (n, rows, rest) in zip(bucket, layout, strict=True):
        width = rows * math.prod(rest)
        whole = received[:, offset : offset + width].reshape(world * rows, *rest)[:n]
        offset += width
        if id(value) in shared:
            done[id(value)] = whole
        yield name, whole


def full_tensor(x: Tensor) -> Tensor:
    """The whole tensor behind a DTensor shard (a collective: every rank must call it, in the
    same order); a plain tensor is returned as it is."""
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full (unsharded) trainable parameters and optimizer state, on the CPU, on every rank.

    ``torch.distributed.checkpoint.state_dict`` gathers them; the optimizer state is keyed by
    parameter name, so it loads into any data-parallel size. (Classic FSDP segfaults gathering
    a full state dict with CPU offload; FSDP2's path here does not.)
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    weights = get_model_state_dict(model, options=options)
    weights = {k: v.detach().cpu() for k, v in weights.items() if k in trainable}
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    return weights, _to_cpu(optim)


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict, optim: dict
) -> None:
    """Load what :func:`full_state` returned into a sharded model and its optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(weights) != trainable:
        missing, extra = sorted(trainable - set(weights)), sorted(set(weights) - trainable)
        raise KeyError(f"state dict mismatch: missing {missing}, extra {extra}")
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, optimizer, optim, options=options)


def _to_cpu(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_cpu(v) for v in x]
    return x
