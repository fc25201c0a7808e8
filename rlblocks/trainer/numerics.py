"""What a trainer computes in, decided once when it is built: bf16 autocast and compiled blocks.

``TrainConfig.bf16`` and ``TrainConfig.compile`` are ``None`` unless set: the trainer decides
them from its model's device here, and the decided values are what ``trainer.config`` shows.

- **bf16** on a GPU (that has it) for a float32 model: ``torch.autocast`` runs the matmuls in
  bf16 while the parameters, AdamW's moments and the master weights stay float32 and the
  log-softmax, log-probs and every loss reduction run in float32
  (``rlblocks.trainer.forward``). That is the mixed precision TRL, verl and torchtitan train
  with; on an H100 a bf16 matmul runs at ~2× the TF32 rate. A model loaded in bf16 or float64
  runs in its own dtype (autocast would change nothing, or lose float64's precision). On the
  CPU autocast's bf16 is slower than float32 (no bf16 matrix units on most CPUs): off.
- **compile** on a GPU (``rlblocks.models.regional``); off on the CPU, where inductor's first
  compile (tens of seconds) is more than a short run gains (``docs/speed.md``).
- **micro_batch_tokens** on a GPU, when neither it nor ``micro_batch_size`` is set: the
  largest budget the device's free memory holds by ``rb.plan``'s arithmetic
  (``rlblocks.planner.budget``), printed with its reason; a GPU runs few large micro-batches
  far faster than many small ones. A budget set by hand that the plan says cannot fit is
  refused before the first step.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from rlblocks.trainer.config import TrainConfig


def resolve_numerics(
    config: TrainConfig, device: torch.device, dtype: torch.dtype, *, owner: str
) -> TrainConfig:
    """``config`` with ``bf16`` and ``compile`` decided for a model on ``device`` with
    parameters of ``dtype`` (module docstring); ``ValueError`` naming ``owner`` for bf16 asked
    on a GPU without it."""
    bf16, compiled = config.bf16, config.compile
    cuda = device.type == "cuda"
    if bf16 is None:
        bf16 = cuda and dtype == torch.float32 and torch.cuda.is_bf16_supported()
    elif bf16 and cuda and not torch.cuda.is_bf16_supported():
        try:
            name = torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError):  # torch sees no CUDA device at all
            name = f"device {device}"
        raise ValueError(
            f"{owner}: bf16=True, and {name} has no bf16 arithmetic; pass bf16=False (float32 "
            "compute; fp16 autocast needs loss scaling, which is not built)"
        )
    if compiled is None:
        compiled = cuda and config.tp == 1 and config.sp == 1
    return dataclasses.replace(config, bf16=bool(bf16), compile=bool(compiled))


def fit_token_budget(
    model: nn.Module,
    config: TrainConfig,
    *,
    owner: str,
    free: int | None = None,
    total: int | None = None,
    world: int = 1,
) -> tuple[TrainConfig, str | None]:
    """``config`` with ``micro_batch_tokens`` filled from the device's free memory, and the
    reason to print (None when nothing was chosen): on a GPU when neither
    ``micro_batch_tokens`` nor ``micro_batch_size`` is set (``rlblocks.planner.budget``). A
    budget the user set is refused when the plan says it cannot fit the free memory at all.
    ``free`` / ``total``: the device's free and total bytes (None: asked of CUDA; on the CPU
    nothing is chosen, every mini-batch is one forward as before)."""
    parameter = next(model.parameters())
    if free is None or total is None:
        if parameter.device.type != "cuda":
            return config, None
        free, total = torch.cuda.mem_get_info(parameter.device)
    auto = config.micro_batch_tokens is None and config.micro_batch_size is None
    if not auto and config.micro_batch_tokens is None:
        return config, None  # rows per forward, as asked
    from rlblocks.planner import model_shape
    from rlblocks.planner.budget import token_budget

    compute = torch.bfloat16 if config.bf16 else parameter.dtype
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
    shape = model_shape(base, dtypes=(compute,))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = dataclasses.replace(shape, trainable=trainable)
    budget = token_budget(
        shape,
        free=free,
        total=total,
        param_dtype=parameter.dtype,
        compute_dtype=compute,
        gradient_checkpointing=config.gradient_checkpointing,
        logprob_chunk_size=config.logprob_chunk_size,
        world=world,
        tp=config.tp,
        sp=config.sp,
    )
    if auto:
        if budget.tokens == 0:
            raise ValueError(
                f"{owner}: the device's free memory ({budget.free / 2**30:.2f} GiB) does not "
                f"hold one forward of {256} tokens after the gradients and AdamW state "
                f"({budget.fixed / 2**30:.2f} GiB) by rb.plan's arithmetic; turn "
                "gradient_checkpointing on, train LoRA, or use a larger device"
            )
        return dataclasses.replace(config, micro_batch_tokens=budget.tokens), budget.reason(owner)
    asked = config.micro_batch_tokens
    assert asked is not None  # not auto, and rows per forward returned above
    need = budget.fixed + budget.per_1k * asked // 1024
    if asked > budget.tokens and need > budget.free:
        raise ValueError(
            f"TrainConfig.micro_batch_tokens: {asked} tokens per forward need about "
            f"{need / 2**30:.2f} GiB by rb.plan's arithmetic (gradients and AdamW "
            f"{budget.fixed / 2**30:.2f} GiB, {budget.per_1k / 2**30:.2f} GiB per 1k tokens) "
            f"and the device has {budget.free / 2**30:.2f} GiB free; pass "
            f"micro_batch_tokens={budget.tokens} or less, or None to have it chosen"
        )
    return config, None
