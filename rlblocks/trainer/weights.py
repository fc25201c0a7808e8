"""What a policy trainer hands a resharder: its full weights, and their spec without values;
and, for its in-memory ``state_dict``, its trainable parameters and its optimizer state in the
keying a sharded trainer loads (`optimizer_state_by_name`).

Both under the Hugging Face names of ``model.state_dict()`` (tied weights under each name):

- :func:`full_weights` yields the tensors: the model's own (shared storage, no copy) in one
  process, all-gathered in buckets when FSDP shards them, W + scaling · B·A with LoRA.
- :func:`full_weight_spec` gives their names, shapes and dtypes from metadata alone, for the check
  before a sync: a sharded ``DTensor``'s ``shape`` is the global one, so nothing is gathered,
  and a LoRA weight has its base weight's shape and dtype, so nothing is merged.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from rlblocks.interfaces import TensorSpec
from rlblocks.trainer.fsdp import gathered
from rlblocks.trainer.lora import base_weights, check_mergeable, merged_weights, with_adapters
from rlblocks.trainer.parallel import DataParallel, SingleProcess


def full_weights(
    model: nn.Module,
    dp: SingleProcess | DataParallel,
    *,
    adapter: bool,
    bucket_bytes: int | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """``(name, whole tensor)`` pairs; sharded tensors are all-gathered in collectives of about
    ``bucket_bytes`` (None: 64 MiB, ``rlblocks.trainer.fsdp.gathered``), so every rank of the
    group must iterate to the end."""
    if adapter and dp.sharded:
        yield from merged_sharded(model, dp, bucket_bytes=bucket_bytes or 64 * 2**20)
    elif adapter:
        yield from merged_weights(model)
    elif not dp.sharded:
        yield from model.state_dict().items()
    else:
        tensors = model.state_dict(keep_vars=True).items()
        yield from gathered(tensors, dp, bucket_bytes=bucket_bytes or 64 * 2**20)


def merged_sharded(
    model: nn.Module, dp: DataParallel, *, bucket_bytes: int
) -> Iterator[tuple[str, Tensor]]:
    """:func:`rlblocks.trainer.lora.merged_weights` of an FSDP-sharded LoRA policy: the base
    weights all-gathered in buckets (`gathered`), each adapted one plus its adapters' delta
    (`rlblocks.trainer.lora.with_adapters`, the single-process merge's own step). Every rank must
    iterate to the end, in the same order: the deltas are collectives too."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
    adapted = {
        f"{name}.weight": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer)
    }
    for key, whole in gathered(base_weights(model, keep_vars=True), dp, bucket_bytes=bucket_bytes):
        module = adapted.get(key)
        yield key, whole if module is None else with_adapters(module, whole)


def full_weight_spec(model: nn.Module, *, adapter: bool) -> dict[str, TensorSpec]:
    """Name -> (shape, dtype) of what :func:`full_weights` yields, in its order."""
    tensors: Iterable[tuple[str, Tensor]]
    if adapter:
        check_mergeable(model)  # refused before a sync starts, not half-way into the first
        tensors = base_weights(model, keep_vars=True)
    else:
        tensors = model.state_dict(keep_vars=True).items()
    return {name: TensorSpec.of(tensor) for name, tensor in tensors}


def trainable_state(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, parameter)`` of the parameters that train (detached, not copied)."""
    return ((n, p.detach()) for n, p in model.named_parameters() if p.requires_grad)


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, model: nn.Module, state: dict[str, Any]
) -> dict[str, Any]:
    """An optimizer ``state_dict`` keyed by parameter name, as a sharded trainer's
    ``set_optimizer_state_dict`` reads it (and its ``state_dict`` returns it).

    A trainer in one process keys its optimizer state by index (torch's own
    ``Optimizer.state_dict``): without this, its ``state_dict`` would not load into the same
    trainer on Ray workers (the live swap of notebook 05). Index ``i`` is the ``i``-th
    parameter of ``optimizer.param_groups`` in order, as torch numbers them, so the groups must
    have the same sizes on both sides (the same model, built the same way). A state already
    keyed by name comes back as it is; the other way needs nothing (torch's
    ``Optimizer.load_state_dict`` pairs the parameters by position, whatever their keys)."""
    sizes = [len(group["params"]) for group in state["param_groups"]]
    ours = [len(group["params"]) for group in optimizer.param_groups]
    if sizes != ours:
        raise ValueError(
            f"PolicyTrainer.load_state_dict: the optimizer state has parameter groups of {sizes} "
            f"parameters, this trainer's has {ours}; load a state_dict of a trainer built on "
            "the same model"
        )
    keys = [key for group in state["param_groups"] for key in group["params"]]
    if not keys or isinstance(keys[0], str):
        return state
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        **state,
        "state": {order[key]: value for key, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [order[key] for key in group["params"]]}
            for group in state["param_groups"]
        ],
    }


@torch.no_grad()
def load_trainable_state(model: nn.Module, values: Mapping[str, Tensor]) -> None:
    """Copy :func:`trainable_state`'s tensors back; a missing or extra name is a ``KeyError``
    naming them."""
    params = dict(trainable_state(model))
    if set(params) != set(values):
        missing, extra = sorted(set(params) - set(values)), sorted(set(values) - set(params))
        raise KeyError(
            f"load_state_dict: state dict mismatch: missing {missing}, extra {extra}; load "
            "a state_dict of a trainer built on the same model"
        )
    for name, value in values.items():
        params[name].copy_(value)


def frozen_reference(model: nn.Module, reference: str | nn.Module | None) -> nn.Module | None:
    """The frozen reference policy a trainer keeps: None, a deep copy of ``model`` ("copy") or
    the given module, without gradient and in ``eval()`` mode."""
    if reference is None:
        return None
    if reference == "copy":
        reference = copy.deepcopy(model)
    elif not isinstance(reference, nn.Module):
        raise ValueError(
            f"PolicyTrainer: reference is {reference!r}; pass 'auto', 'copy', a module or None"
        )
    return reference.requires_grad_(False).eval()
