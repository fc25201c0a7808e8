"""Counting host reads: the CPU proxy of the device-to-host syncs of a step on a GPU.

On a GPU, a value read back to the host (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``)
or an operator whose output size depends on the data (``nonzero``, boolean indexing,
``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``) waits for every
kernel queued before it. On the CPU nothing waits, but the same calls happen: this mode counts
them during a block, whatever device the tensors are on. It is stricter than a GPU (a read of
a tensor that would live on the host there counts too).
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any, Self

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: Tensor methods that copy values to Python or NumPy (seen by a torch-function mode). Moves
#: (``.to(device)``, ``.cpu()``) are not counted: on the CPU a move to the model's device
#: cannot be told from a move to the host.
READS = {"tolist", "numpy"}
#: Operators that read a value or size their output by the data (seen by a dispatch mode).
SYNCING = {
    "aten._local_scalar_dense.default",  # .item(), bool(), int(), float()
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_consecutive.default",
    "aten.unique_dim.default",
}
#: Counted only without ``output_size`` (given it, the output's size is known in advance).
SIZED_BY_DATA = "aten.repeat_interleave.Tensor"


class _Functions(TorchFunctionMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        name = getattr(func, "__name__", "")
        if name in READS:
            _count(self.counts, name)
        return func(*args, **(kwargs or {}))


class _Operators(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        name = str(func)
        if name in SYNCING or (name == SIZED_BY_DATA and (kwargs or {}).get("output_size") is None):
            _count(self.counts, name)
        elif name == "aten.index.Tensor" and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        ):
            _count(self.counts, "aten.index.Tensor(bool)")
        return func(*args, **(kwargs or {}))


def _count(counts: Counter, name: str) -> None:
    """Count ``name`` at the innermost line of rlblocks that made the call."""
    frames = [f for f in traceback.extract_stack() if "/rlblocks/" in f.filename]
    where = f"{frames[-1].filename.split('/rlblocks/')[-1]}:{frames[-1].lineno}" if frames else "?"
    counts[f"{name} @ {where}"] += 1


class HostReads:
    """``with HostReads() as reads: ...``; then ``reads.counts`` (a ``Counter`` by call) and
    ``reads.total``."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._modes = (_Functions(self.counts), _Operators(self.counts))

    def __enter__(self) -> Self:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @property
    def total(self) -> int:
        """Every counted read."""
        return sum(self.counts.values())
