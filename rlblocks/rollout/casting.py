"""What lands in an engine that keeps its weights in a narrower dtype than the trainer's: checked.

A float32 (or bfloat16) trainer syncing into a float16 engine (`HFEngine` around a float16
model, ``VLLMEngine(dtype="float16")``) casts every weight on the way in; a value beyond
float16's largest, 65504, becomes ±inf there while the trainer's own copy stays finite. Nothing
fails at the sync: the next ``generate`` meets non-finite scores and its error, rightly for a
broken model, suggests a lower learning rate, not the cast that did it. So every engine's copy
calls `check_cast` before it writes: it names the tensor, its largest magnitude and the dtype
that cannot hold it, and nothing of the call is copied.

Only casts into a narrower exponent range are checked (fewer exponent bits: float32 or bfloat16
into float16, anything into a float8): a copy into the same or a wider range (float32 into
bfloat16, which has float32's exponent range, the usual set-up) costs nothing, since a finite
value overflows there only within 0.4 % of float32's largest, where the trainer's own weights
are about to overflow anyway. The cost of a checked cast: one read of each tensor
(``torch.aminmax``, no temporary the size of the tensor) and a few scalar operations per
tensor, with one host synchronization per call, where the copy itself reads and writes each
tensor. Measured with benchmarks/cast_check.py on the CPU (one thread, a shared 2-core
machine, two runs), float32 trainer into a float16 `HFEngine`: the tiny model (0.12 M weights
in 27 tensors) 0.50 ms a sync with the check against 0.09 ms without, the fixed cost of a few
small operations per tensor; a 17 M-weight model (51 tensors) 23-32 ms against 13-17 ms, about
one more read of the weights. Small beside a step's sampling and update.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

__all__ = ["check_cast", "narrows"]


def narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """True when casting floating ``source`` values to a floating ``target`` narrows their
    exponent range (module docstring): float32 into float16 does, float32 into bfloat16 not."""
    if not (source.is_floating_point and target.is_floating_point):
        return False
    return _top_exponent(target) < _top_exponent(source)


def _top_exponent(dtype: torch.dtype) -> int:
    """The binary exponent of ``dtype``'s largest finite value (float32 128, float16 16)."""
    return math.frexp(torch.finfo(dtype).max)[1]


def check_cast(
    weights: Iterable[tuple[str, Tensor]], dtypes: Mapping[str, torch.dtype], *, owner: str
) -> None:
    """Raise ``FloatingPointError`` if a weight would not be finite once cast to its engine
    dtype ``dtypes[name]`` (names missing from ``dtypes`` are not checked); ``owner`` is the
    block whose copy this is. The error names the tensor, its largest |value| and the dtype,
    and tells a weight that overflows in the cast from one the trainer already holds broken."""
    peaks: list[tuple[str, torch.dtype, Tensor]] = []  # name, engine dtype, max |value| (0-d)
    for name, value in weights:
        target = dtypes.get(name)
        if target is None or value.numel() == 0 or not narrows(value.dtype, target):
            continue
        low, high = torch.aminmax(value.detach())
        peaks.append((name, target, torch.maximum(high, -low)))  # NaN stays NaN
    if not peaks:
        return
    landed = torch.stack([torch.isfinite(peak.to(target)) for _, target, peak in peaks])
    if bool(landed.all()):  # the one host synchronization
        return
    name, target, peak = peaks[int((~landed).nonzero()[0])]
    largest = float(peak)
    if not math.isfinite(largest):
        raise FloatingPointError(
            f"{owner}: the trainer's weight {name!r} is not finite already (max |value| = "
            f"{largest}), before any cast; nothing of this call was copied. The update broke "
            "it: lower lr, set max_grad_norm, or resume from an earlier checkpoint"
        )
    raise FloatingPointError(
        f"{owner}: the trainer's weight {name!r} holds values up to |x| = {largest:.6g}, beyond "
        f"{str(target).removeprefix('torch.')}'s largest ({torch.finfo(target).max:g}): cast "
        f"into the engine it would become inf, so the engine would sample from a broken model "
        "while the trainer's copy is fine; nothing of this call was copied. Keep the engine in "
        "bfloat16 or float32 (bfloat16 has float32's range), or keep the weights smaller "
        "(lower lr, set max_grad_norm or weight_decay)"
    )
