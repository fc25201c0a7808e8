"""What the recipes share: the default sampling, the default policy loss, the callback type.

One module so that no recipe imports another for a constant.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from rlblocks.interfaces import Rollouts, SamplingParams
from rlblocks.losses import clipped_surrogate
from rlblocks.rollout.hf import HFEngine
from rlblocks.trainer.policy import PolicyTrainer

DEFAULT_SAMPLING = SamplingParams(max_new_tokens=128)
"""Sampling of every recipe unless told otherwise: temperature 1, at most 128 new tokens."""

PPO_CLIP = partial(clipped_surrogate, clip=(0.2, 0.2))
"""The policy loss of GRPO, PPO and ReMax: the clipped surrogate with ε = 0.2 both ways."""

StepCallback = Callable[[int, dict[str, Any], Rollouts], None]
"""``on_step(step, metrics, rollouts)``, called after every step; raise ``StopIteration`` in it
to end the run early."""

DapoStepCallback = Callable[[int, dict[str, Any], Rollouts | None], None]
"""DAPO's ``on_step``: ``rollouts`` is None for a step skipped for want of informative groups."""


def samples_with_policy(policy: Any, engine: Any, sampling: SamplingParams) -> bool:
    """True when ``engine`` samples with ``policy``'s own module at its temperature: an
    in-process `HFEngine` around ``policy.model`` (the README's and the main job's setup).

    Its rollout log-probs are then π_old, the log-probs the trainer would compute before the
    update (up to the rounding of cached against uncached attention), and the recipes take
    them instead of paying a forward pass for them (``reuse_rollout_logprobs=None``). A
    separate engine (its own copy, vLLM, a Ray worker) is never taken for it: a copy can be
    stale, and another kernel or dtype gives other numbers (docs/blocks/losses.md, mismatch).
    Greedy sampling (T = 0) reports log-probs at T = 1.
    """
    if not isinstance(policy, PolicyTrainer) or not isinstance(engine, HFEngine):
        return False  # Ray handles land here: nothing is fetched to find out
    temperature = sampling.temperature or 1.0
    return engine.model is policy.model and temperature == policy.config.temperature


def reuses_rollout_logprobs(
    reuse: bool | None, policy: Any, engine: Any, sampling: SamplingParams
) -> bool:
    """A recipe's ``reuse_rollout_logprobs``: as given, or :func:`samples_with_policy` (None)."""
    return samples_with_policy(policy, engine, sampling) if reuse is None else reuse


__all__ = [
    "DEFAULT_SAMPLING",
    "PPO_CLIP",
    "DapoStepCallback",
    "StepCallback",
    "reuses_rollout_logprobs",
    "samples_with_policy",
]
