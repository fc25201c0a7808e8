"""What the recipes share: the default sampling and the default policy loss.

One module so that no recipe imports another for a constant. How a run is driven (the loop,
checkpoints, where rollouts and π_old come from) is the run floor's, `rlblocks.run`.
"""

from __future__ import annotations

from functools import partial

from rlblocks.interfaces import SamplingParams
from rlblocks.losses import clipped_surrogate

DEFAULT_SAMPLING = SamplingParams(max_new_tokens=128)
"""Sampling of every recipe unless told otherwise: temperature 1, at most 128 new tokens."""

PPO_CLIP = partial(clipped_surrogate, clip=(0.2, 0.2))
"""The policy loss of GRPO, PPO and ReMax: the clipped surrogate with ε = 0.2 both ways."""

__all__ = ["DEFAULT_SAMPLING", "PPO_CLIP"]
