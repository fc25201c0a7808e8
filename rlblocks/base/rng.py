"""The random state of a process: Python's, NumPy's, torch's on the CPU and on every CUDA device.

A run resumed with `set_rng_state(rng_state())` of the moment it was saved draws the same
samples as the run that was not interrupted: the HF engine samples from torch's global
generator, `PromptBatches` and Python's ``random`` are used by data code, NumPy's by users.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """A copy of every global random state of this process."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned. A CUDA state saved on a machine with another number of
    GPUs, or saved without CUDA, is an error only when CUDA is here and the counts differ. A
    state without ``"python"`` or ``"numpy"`` (an older `PolicyTrainer.state_dict`, which kept
    torch's alone) leaves those generators as they are."""
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"set_rng_state: the checkpoint holds the random state of {len(cuda)} CUDA "
                f"devices, this process sees {torch.cuda.device_count()}; resume with "
                f"{len(cuda)} visible devices (CUDA_VISIBLE_DEVICES)"
            )
        torch.cuda.set_rng_state_all(cuda)


__all__ = ["rng_state", "set_rng_state"]
