"""FSDP2 for the trainers: sharding a model, gathering its weights, its full state.

A trainer sharded over a data-parallel group (``PolicyTrainer.shard``, ``CriticTrainer.shard``)
has every decoder layer and then the whole model as FSDP2 units
(``torch.distributed.fsdp.fully_shard``); its gradients are *summed* over the ranks, because
each rank's loss already carries the mini-batch's global normalizer
(``rlblocks.trainer.parallel``). Gloo serves CPUs, NCCL GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlblocks.trainer.parallel import DataParallel, SingleProcess
from rlblocks.trainer.shared_gather import gather_rows, shared_group

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


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


def shard_modules(
    group: Any,
    config: FSDP | None,
    *,
    trainable: nn.Module,
    frozen: Iterable[nn.Module | None] = (),
    tp: int = 1,
    sp: int = 1,
    owner: str = "PolicyTrainer.shard",
) -> SingleProcess | DataParallel:
    """The sharding rule of every trainer: the ``dp`` it keeps for ``group``.

    ``tp == 1``: a group of one process stays whole (:class:`SingleProcess`) unless ``config``
    is given: an ``FSDP(...)`` shards even then (FSDP2 at world size 1: mixed precision, CPU
    offload). Else ``trainable`` (gradients summed over ranks) and every ``frozen`` module (a
    reference policy) are sharded with :func:`shard_module`.

    ``tp > 1``: the world becomes a ``(dp, tp)`` device mesh (``dp = W / tp``; tensor-parallel
    groups of consecutive ranks); every module is split over its ``tp`` group first
    (``rlblocks.trainer.tensor_parallel``), then FSDP2-sharded over its ``dp`` group, as
    torchtitan composes them. The layout is checked against the model's sizes and the world
    before any collective. Rebuild the optimizer afterwards.
    """
    if sp > 1:
        dp = sequence_parallel_group(group, trainable, sp, owner=owner)
        mesh = _mesh_of(group, trainable)
    elif tp == 1:
        dp = DataParallel(group)
        if dp.size == 1 and config is None:
            return SingleProcess()
        mesh = _mesh_of(group, trainable)
    else:
        mesh = tensor_parallel_mesh(group, trainable, frozen, tp, owner=owner)
        dp = DataParallel(mesh["dp"].get_group(), everyone=dist.group.WORLD)
    config = config or FSDP()
    shard_module(trainable, mesh, config, trainable=True)
    for module in frozen:
        if module is not None:
            shard_module(module, mesh, config, trainable=False)
    return dp


def tensor_parallel_mesh(
    group: Any, trainable: nn.Module, frozen: Iterable[nn.Module | None], tp: int, *, owner: str
) -> Any:
    """Check the ``(dp, tp)`` layout, build its mesh over the default group, and split every
    module over the mesh's ``tp`` dimension; returns the mesh's ``dp`` dimension (FSDP's)."""
    from torch.distributed.device_mesh import init_device_mesh

    from rlblocks.trainer.tensor_parallel import check_groups, check_layout, parallelize

    world = _check_world(group, "tensor", "tp", tp, owner=owner)
    modules = [trainable, *(m for m in frozen if m is not None)]
    plans = [check_layout(m, tp, owner=owner) for m in modules]  # before any collective
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    check_groups(hosts, tp, owner=owner)
    device = next(trainable.parameters()).device
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    for module, plan in zip(modules, plans, strict=True):
        parallelize(module, mesh["tp"], plan)
    return mesh["dp"]


def sequence_parallel_group(group: Any, model: nn.Module, sp: int, *, owner: str) -> DataParallel:
    """Check the sequence-parallel layout (``sp`` divides the processes and the attention
    heads) and build the groups of ``sp`` consecutive ranks; FSDP2 then shards over every
    rank (each rank's gradient covers its own tokens: summed, they are the update's)."""
    world = _check_world(group, "sequence", "sp", sp, owner=owner)
    config = model.config.get_text_config() if hasattr(model, "config") else None  # type: ignore[union-attr, operator]  # Module.__getattr__ is typed Tensor | Module
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and heads % sp:
        raise ValueError(
            f"{owner}: num_attention_heads = {heads} is not divisible by the sequence-parallel "
            f"size sp = {sp} (each rank attends with heads / sp of them); pick an sp that "
            f"divides {heads}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (world // sp, sp), mesh_dim_names=("dp", "sp"))
    return DataParallel(group, sequence=mesh["sp"].get_group())


def _check_world(group: Any, kind: str, name: str, size: int, *, owner: str) -> int:
    """The number of processes, once shown to be the default group's and a multiple of the
    ``kind``-parallel size ``name`` = ``size``."""
    world = dist.get_world_size(group)
    if group is not None and group is not dist.group.WORLD:
        raise ValueError(
            f"{owner}: {kind} parallelism ({name} = {size}) builds its mesh over every process "
            "of the default group; call shard() without a group"
        )
    if world % size:
        raise ValueError(
            f"{owner}: the {kind}-parallel size {name} = {size} does not divide the {world} "
            f"processes of the group; use a {name} that divides {world}, or {size}·k processes"
        )
    return world


def _mesh_of(group: Any, model: nn.Module) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    device = next(model.parameters()).device
    world = dist.group.WORLD
    assert world is not None  # shard() runs inside an initialized process group
    return DeviceMesh.from_group(group or world, device_type=device.type)


def shard_module(model: nn.Module, mesh: Any, config: FSDP, *, trainable: bool) -> None:
    """Every decoder layer of ``model`` (the classes its ``_no_split_modules`` names), then the
    model itself, become FSDP2 units over the 1-D device ``mesh``; ``trainable`` ones sum
    gradients."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )

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
            f"shard_modules: {type(model).__name__} names no decoder-layer class in "
            "_no_split_modules, so FSDP cannot tell which modules to shard; set the model "
            "class's _no_split_modules to its decoder-layer class names"
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
    A gloo group whose ranks all run on this machine skips the flat buffer and gloo's TCP: each
    rank writes its rows straight into a shared-memory bucket (``rlblocks.trainer.shared_gather``).
    """
    named = list(named)  # references only
    counts = Counter(id(value) for _, value in named)
    shared = {i for i, c in counts.items() if c > 1}  # kept after gathering; the rest is not
    pending: list[tuple[str, DTensor]] = []
    size = 0
    done: dict[int, Tensor] = {}
    # the least size of a shared-memory bucket: one that fits every later bucket, no larger
    # than the model (shared_gather.gather_rows)
    reserve = min(bucket_bytes, sum(v.numel() * v.element_size() for _, v in named))
    for name, value in named:
        if id(value) in done or not _row_sharded(value, dp):
            yield from _gather_bucket(pending, dp, done, shared, reserve)
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
            yield from _gather_bucket(pending, dp, done, shared, reserve)
            pending, size = [], 0
        pending.append((name, value))
        size += nbytes
    yield from _gather_bucket(pending, dp, done, shared, reserve)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _row_sharded(x: Tensor, dp: DataParallel) -> TypeGuard[DTensor]:
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(x, DTensor)
        and x.dim() > 0
        and x.device_mesh.size() == dist.get_world_size(dp.group)
        and tuple(x.placements) == (Shard(0),)
    )


def _gather_bucket(
    bucket: list[tuple[str, DTensor]],
    dp: DataParallel,
    done: dict[int, Tensor],
    shared: set[int] | None = None,
    reserve: int = 0,
) -> Iterator[tuple[str, Tensor]]:
    if not bucket:
        return
    shared = shared or set()
    owner = shared_group(dp.group) if dp.device is None else None  # gloo: all on this machine?
    if owner is not None:  # through shared memory (rlblocks.trainer.shared_gather)
        locals_ = [value.to_local().detach() for _, value in bucket]
        shapes = [value.shape for _, value in bucket]
        wholes = gather_rows(locals_, shapes, group=dp.group, owner=owner, reserve=reserve)
    else:
        wholes = _all_gather_bucket([value for _, value in bucket], dp)
    for (name, value), whole in zip(bucket, wholes, strict=True):
        if id(value) in shared:
            done[id(value)] = whole
        yield name, whole


def _all_gather_bucket(values: list[DTensor], dp: DataParallel) -> list[Tensor]:
    """The whole tensors of ``values`` (row-sharded DTensors) by one ``all_gather_single``."""
    world = dist.get_world_size(dp.group)  # FSDP shards (all ranks under sp)
    pieces, layout = [], []
    for value in values:
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
    wholes, offset = [], 0
    for n, rows, rest in layout:
        width = rows * math.prod(rest)
        wholes.append(received[:, offset : offset + width].reshape(world * rows, *rest)[:n])
        offset += width
    return wholes


def full_tensor(x: Tensor) -> Tensor:
    """The whole tensor behind a DTensor shard (a collective: every rank must call it, in the
    same order); a plain tensor is returned as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return x
    with _quiet_redistribution():
        return x.full_tensor()


@contextlib.contextmanager
def _quiet_redistribution() -> Iterator[None]:
    """DTensor logs a warning for every FSDP x TP tensor it makes whole ("2 sequential
    all_gather operations will be performed"): true, and known; not news at every sync."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


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
    weights = {k: v.detach().cpu() for k, v in weights.items() if k in trainable}  # type: ignore[union-attr]  # a model's state dict: tensors
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
        raise KeyError(
            f"load_state_dict: state dict mismatch: missing {missing}, extra {extra}; load "
            "a state_dict of a trainer built on the same model"
        )
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
