"""Where a block puts the model it loads: one rule for every ``from_pretrained``.

- ``device=None`` (the default everywhere): CUDA when torch sees a GPU, else the CPU
  (:func:`default_device`), so that a notebook on a GPU kernel trains on the GPU.
- an explicit ``device`` wins, but a device torch does not see (``"cuda"`` on a machine or a
  torch build without CUDA, ``"cuda:3"`` with two GPUs visible, ``"mps"`` off Apple silicon)
  is refused before anything is loaded, with what torch sees and the fix
  (:func:`resolve_device`).

Blocks that wrap a model they are given (``HFEngine(policy.model, ...)``, ``ValueModel(model)``,
``Teacher(model)``) keep that model's device.
"""

from __future__ import annotations

import os
from typing import Any

import torch

Device = str | torch.device | None
"""What a ``device=`` argument takes: a name (``"cuda:1"``), a ``torch.device``, or None."""


def default_device(available: bool | None = None) -> torch.device:
    """``cuda`` when CUDA is available, else ``cpu``.

    ``available``: whether CUDA is; None reads ``torch.cuda.is_available()`` (a test passes the
    answer it needs rather than patching torch). The current CUDA device is used (``cuda``
    without an index), so ``CUDA_VISIBLE_DEVICES`` and ``torch.cuda.set_device`` pick the GPU.
    """
    if available is None:
        available = torch.cuda.is_available()
    return torch.device("cuda" if available else "cpu")


def resolve_device(device: Device, *, owner: str) -> torch.device:
    """``device`` as a ``torch.device``, checked to exist here; None gives :func:`default_device`.

    Raises ``ValueError`` for a name torch does not know (``"gpu"``) and ``RuntimeError`` for a
    device torch does not see; both name ``owner`` (the block called), the device, what torch
    sees and what to pass instead. Nothing is allocated on the device.
    """
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"{owner}: device {device!r} is not a device torch knows; pass 'cuda', "
            "'cuda:N', 'cpu' or 'mps', or leave device out (CUDA when torch sees a GPU, else "
            "the CPU)"
        ) from error
    missing = _missing(resolved)
    if missing is not None:
        seen, fix = missing
        raise RuntimeError(f"{owner}: device {str(resolved)!r} was asked for, but {seen}; {fix}")
    return resolved


ELSEWHERE = "pass device='cpu', or leave device out (CUDA when torch sees a GPU, else the CPU)"


def _missing(device: torch.device) -> tuple[str, str] | None:
    """(what torch sees instead of ``device``, what to do) when torch cannot use it; else None."""
    if device.type == "cuda":
        return _missing_cuda(device.index)
    if device.type == "mps":
        if torch.backends.mps.is_available():
            return None
        return (
            "torch sees no MPS device (MPS needs Apple silicon and macOS 12.3 or later)",
            ELSEWHERE,
        )
    backend: Any = getattr(torch, device.type, None)  # torch.xpu, torch.npu...
    if device.type in ("cpu", "meta") or not hasattr(backend, "is_available"):
        return None  # the CPU, the meta device, or a backend torch cannot be asked about
    if not backend.is_available():
        return f"torch sees no {device.type} device", ELSEWHERE
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is None or device.index < count:
        return None
    return f"torch sees {count} {device.type} device(s)", f"pass an index below {count}"


def _missing_cuda(index: int | None) -> tuple[str, str] | None:
    """(what torch sees instead of CUDA device ``index``, what to do), or None when it is there
    (``index`` None: the current CUDA device)."""
    if torch.version.cuda is None:
        seen = f"torch {torch.__version__} is a build without CUDA"
        return seen, f"{ELSEWHERE}, or install a CUDA build of torch"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        seen = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU{where}"
        return seen, f"{ELSEWHERE}, or check the GPU and its driver with nvidia-smi"
    if index is None or index < count:
        return None
    names = ", ".join(f"cuda:{i}" for i in range(count))
    seen = f"torch sees {count} CUDA device(s) ({names}{where})"
    return seen, "pass one of those, or leave device out (the current CUDA device)"
