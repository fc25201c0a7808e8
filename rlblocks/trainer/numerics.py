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
"""

from __future__ import annotations

import dataclasses

import torch

from rlblocks.trainer.config import TrainConfig


def resolve(
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
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"{owner}: bf16=True, and {name} has no bf16 arithmetic; pass bf16=False (float32 "
            "compute; fp16 autocast needs loss scaling, which is not built)"
        )
    if compiled is None:
        compiled = cuda and config.tp == 1 and config.sp == 1
    return dataclasses.replace(config, bf16=bool(bf16), compile=bool(compiled))
