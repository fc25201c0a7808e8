"""The token budget of a training forward that fills the device (``micro_batch_tokens``).

A GPU runs a few large micro-batches far faster than many small ones (each forward launches
the same kernels whatever its size; a small one leaves the chip idle). So when a trainer on a
GPU is given neither ``micro_batch_tokens`` nor ``micro_batch_size``, it asks
:func:`token_budget` for the largest budget its free memory holds, by the planner's own
arithmetic (:mod:`rlblocks.planner.sizing`):

    free − MARGIN × total ≥ gradients + AdamW state
                            + activations(tokens) + head(tokens)

where the activations and the head's working set are the plan's parts for a forward of that
many tokens (in the compute dtype: bf16 under autocast). The budget is a multiple of
:data:`STEP` tokens, found by bisection (both parts grow with the tokens). A budget the user
set is checked the same way, and refused with the largest that fits, before the first step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlblocks.planner.shapes import ModelShape
from rlblocks.planner.sizing import GIB, MARGIN, Setup, _size

STEP = 256
"""Budgets are multiples of this many tokens."""
CEILING = 1 << 20
"""The largest budget offered (a million tokens per forward)."""


@dataclass(frozen=True)
class Budget:
    """What :func:`token_budget` found: ``tokens`` (0 when not even :data:`STEP` fits), the
    fixed bytes it had to leave (gradients, AdamW state), the bytes per 1k tokens at that
    budget, and the memory it divided."""

    tokens: int
    fixed: int
    per_1k: int
    usable: int
    free: int

    def reason(self, owner: str) -> str:
        """One line saying what was chosen and from what, naming ``owner``."""
        return (
            f"{owner}: micro_batch_tokens={self.tokens} fills {_g(self.usable)} of "
            f"{_g(self.free)} free (keeping {MARGIN:.0%} of the device): gradients and AdamW "
            f"{_g(self.fixed)}, activations and head {_g(self.per_1k)} per 1k tokens; set "
            "TrainConfig.micro_batch_tokens to choose another"
        )


def token_budget(
    shape: ModelShape,
    *,
    free: int,
    total: int,
    param_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    gradient_checkpointing: bool = False,
    logprob_chunk_size: int = 1024,
    world: int = 1,
    tp: int = 1,
    sp: int = 1,
) -> Budget:
    """The largest multiple of :data:`STEP` tokens per forward that ``free`` bytes of a device
    of ``total`` bytes hold (module docstring); asked before the first step, so the gradients
    and AdamW's state are still to be allocated."""
    if compute_dtype not in shape.act_per_token:
        raise ValueError(
            f"token_budget: the model's layer was not traced in {compute_dtype}; size the shape "
            f"with model_shape(..., dtypes=({compute_dtype},))"
        )
    shards = world // tp
    b = param_dtype.itemsize
    fixed = shape.trainable * b * 3 // (tp * shards)  # gradients and AdamW's two moments
    setup = Setup(
        dtype=param_dtype,
        optimizer="adamw",
        lora=shape.trainable < shape.params,
        reference=False,
        gradient_checkpointing=gradient_checkpointing,
        tokens=STEP,
        logprob_chunk_size=logprob_chunk_size,
        world=world,
        tp=tp,
        sp=sp,
        engine=None,
        rollout_rows=1,
        rollout_tokens=1,
        engine_copy=False,
        colocated=True,
        sleep=False,
        gpu_memory_utilization=0.5,
        autocast=compute_dtype == torch.bfloat16 and param_dtype != torch.bfloat16,
    )

    def working(tokens: int) -> int:  # activations and the head's working set at this budget
        parts = _size(shape, dataclasses.replace(setup, tokens=tokens), None).trainer
        return parts["activations"] + parts["logits"]

    usable = max(free - int(MARGIN * total), 0)
    low, high = 0, CEILING // STEP  # in steps: low fits (0 always), high + 1 does not
    if fixed + working(STEP) > usable:
        high = 0
    while low < high:
        mid = (low + high + 1) // 2
        if fixed + working(mid * STEP) <= usable:
            low = mid
        else:
            high = mid - 1
    tokens = low * STEP
    per_1k = working(max(tokens, STEP)) * 1024 // max(tokens, STEP)
    return Budget(tokens=tokens, fixed=fixed, per_1k=per_1k, usable=usable, free=free)


def _g(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
