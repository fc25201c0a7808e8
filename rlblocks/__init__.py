"""rlblocks: notebook-first building blocks for RL of large language models.

    import rlblocks as rb
    adv, ret = rb.advantage.grpo(rewards, ro.response_mask, ro.group_ids)
    loss, metrics = rb.losses.clipped_surrogate(logp, old_logp, adv, mask, clip=(0.2, 0.28))

Subpackages: ``advantage`` (estimators), ``losses`` (per-token losses and ``aggregate``),
``rewards`` (rule-based rewards), ``placement`` (where blocks run). ``interfaces`` holds the
block contracts and ``Rollouts`` the batch type.
"""

from rlblocks import advantage, interfaces, losses, placement, rewards
from rlblocks.interfaces import Advantages, RewardOutput, SamplingParams
from rlblocks.rollouts import Rollouts

__version__ = "0.1.0"

__all__ = [
    "Advantages",
    "RewardOutput",
    "Rollouts",
    "SamplingParams",
    "advantage",
    "interfaces",
    "losses",
    "placement",
    "rewards",
]
