"""Rollout engines: sample responses to prompts and return a ``Rollouts`` batch.

``HFEngine`` runs Hugging Face ``model.generate`` in the calling process. Every engine follows
the ``RolloutEngine`` protocol of :mod:`rlblocks.interfaces`.
"""

from rlblocks.rollout.hf import HFEngine, sampled_logprobs
from rlblocks.rollout.prompts import left_pad, render_prompts
from rlblocks.rollout.stopping import ResponseEnds, valid_tokens

__all__ = [
    "HFEngine",
    "ResponseEnds",
    "left_pad",
    "render_prompts",
    "sampled_logprobs",
    "valid_tokens",
]
