"""What the recipes share: the default sampling, the default policy loss, the callback type.

One module so that no recipe imports another for a constant.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from rlblocks.interfaces import Rollouts, SamplingParams
from rlblocks.losses import clipped_surrogate

DEFAULT_SAMPLING = SamplingParams(max_new_tokens=128)
"""Sampling of every recipe unless told otherwise: temperature 1, at most 128 new tokens."""

PPO_CLIP = partial(clipped_surrogate, clip=(0.2, 0.2))
"""The policy loss of GRPO, PPO and ReMax: the clipped surrogate with ε = 0.2 both ways."""

StepCallback = Callable[[int, dict[str, Any], Rollouts], None]
"""``on_step(step, metrics, rollouts)``, called after every step; raise ``StopIteration`` in it
to end the run early."""

DapoStepCallback = Callable[[int, dict[str, Any], Rollouts | None], None]
"""DAPO's ``on_step``: ``rollouts`` is None for a step skipped for want of informative groups."""

__all__ = ["DEFAULT_SAMPLING", "PPO_CLIP", "DapoStepCallback", "StepCallback"]
