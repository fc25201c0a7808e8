"""The critic of PPO: a value model (transformer + scalar head) and its trainer.

critic = CriticTrainer(policy.model, lr=1e-5)        # backbone copied, zero-initialised head
values = critic.values(rollouts)                      # (b t) V(s_k), before token k
logs = critic.step(rollouts, returns, old_values=values, clip=0.2)
"""

from rlblocks.critic.trainer import CriticTrainer
from rlblocks.critic.value_model import ValueModel

__all__ = ["CriticTrainer", "ValueModel"]
