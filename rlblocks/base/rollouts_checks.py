"""Shape and dtype checks of the fields of a `rlblocks.rollouts.Rollouts`, each raising an
error that names the field, its shape and what was expected; the check of the masks' values,
skipped for a batch `derived` from a checked one; and the check that the parts of
``Rollouts.concat`` carry the same fields. Imports nothing of rlblocks."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor


def shape_of(x: Tensor) -> str:
    """The shape of ``x`` as a tuple string, for messages."""
    return str(tuple(x.shape))


def expect_dims(name: str, x: Any, dims: int) -> None:
    """Raise unless field ``name`` is a tensor with ``dims`` dimensions."""
    if not isinstance(x, Tensor):
        raise TypeError(
            f"Rollouts.{name}: must be a torch.Tensor, got {type(x).__name__}; pass a tensor"
        )
    if x.dim() != dims:
        raise ValueError(
            f"Rollouts.{name}: must have {dims} dimensions, got shape {shape_of(x)}; pass a "
            f"{dims}-D tensor"
        )


def expect_shape(name: str, x: Any, shape: tuple[int, ...], why: str) -> None:
    """Raise unless field ``name`` is a tensor of ``shape``; ``why`` explains it."""
    if not isinstance(x, Tensor):
        raise TypeError(
            f"Rollouts.{name}: must be a torch.Tensor, got {type(x).__name__}; pass a tensor"
        )
    if tuple(x.shape) != shape:
        raise ValueError(
            f"Rollouts.{name}: has shape {shape_of(x)}, expected {shape} ({why}); pass a tensor "
            "of that shape"
        )


def expect_bool(name: str, x: Tensor) -> None:
    """Raise unless field ``name`` is a bool tensor (masks: True = the token counts)."""
    if x.dtype != torch.bool:
        raise TypeError(
            f"Rollouts.{name}: must be torch.bool (True = the token counts), got {x.dtype}; "
            f"convert with .bool()"
        )


def expect_dtype(name: str, x: Tensor, *, integer: bool) -> None:
    """Raise unless field ``name`` has an integer (``integer``) or a floating dtype."""
    is_int = not x.dtype.is_floating_point and not x.dtype.is_complex and x.dtype != torch.bool
    if integer and not is_int:
        raise TypeError(
            f"Rollouts.{name}: must be an integer tensor, got {x.dtype}; convert with .long()"
        )
    if not integer and not x.dtype.is_floating_point:
        raise TypeError(
            f"Rollouts.{name}: must be a floating-point tensor, got {x.dtype}; convert with "
            ".float()"
        )


def check_extra(name: str, value: Any, b: int, t: int) -> None:
    """Raise unless extra ``name`` is a tensor of b rows, response-aligned (t) when per token."""
    if not isinstance(value, Tensor):
        raise TypeError(
            f"Rollouts.extras[{name!r}]: must be a Tensor, got {type(value).__name__}; store "
            "tensors in extras"
        )
    if value.dim() == 0 or value.shape[0] != b:
        raise ValueError(
            f"Rollouts.extras[{name!r}]: has shape {shape_of(value)}, expected (b=={b}, ...); "
            "give an extra one entry per row"
        )
    if value.dim() >= 2 and value.shape[1] != t:
        raise ValueError(
            f"Rollouts.extras[{name!r}]: has shape {shape_of(value)}, but a per-token extra "
            f"must be response-aligned; pass (b t ...) with t=={t}"
        )


def check_parts_alike(parts: Sequence[Any], optional: Sequence[str]) -> None:
    """Raise unless every part of ``Rollouts.concat`` has each ``optional`` field (or none
    has it) and every part has the same extras, naming the field or the first part that
    differs."""
    for name in optional:
        if len({getattr(p, name) is not None for p in parts}) > 1:
            raise ValueError(
                f"Rollouts.concat: some parts have {name} and some do not; give it to "
                "every part or to none"
            )
    keys = set(parts[0].extras)
    for i, p in enumerate(parts):
        if set(p.extras) != keys:
            raise ValueError(
                f"Rollouts.concat: part {i} has extras {sorted(p.extras)}, "
                f"part 0 has {sorted(keys)}; give every part the same extras"
            )


_derivation = threading.local()


@contextlib.contextmanager
def derived() -> Iterator[None]:
    """Batches built inside are derived from a checked one (its rows, its used columns, or
    fields other than the masks replaced): their shape checks run, the checks of the masks'
    values (a read of the data) are skipped."""
    before = getattr(_derivation, "active", False)
    _derivation.active = True
    try:
        yield
    finally:
        _derivation.active = before


def check_no_counted_padding(response_mask: Tensor, response_attention: Tensor) -> None:
    """Raise if ``response_mask`` (b t) is True where ``response_attention`` (b t, the
    response part of the attention mask) is False: a token that counts must be a real one."""
    counted_padding = response_mask & ~response_attention
    # Value checks need data: a batch on the meta device (shape planning) skips them, and so
    # does one built inside ``derived()``: on a GPU each is a host read.
    skip = counted_padding.device.type == "meta" or getattr(_derivation, "active", False)
    if not skip and counted_padding.any():
        row = int(counted_padding.any(-1).nonzero()[0])
        raise ValueError(
            f"Rollouts.response_mask: True on padding (attention_mask False) in row {row}; "
            "set it False there (a token that counts in the loss must be a real token)"
        )
