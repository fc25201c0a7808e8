"""rlblocks: notebook-first building blocks for RL of large language models."""

from rlblocks.interfaces import Advantages, RewardOutput, SamplingParams
from rlblocks.rollouts import Rollouts

__version__ = "0.1.0"

__all__ = ["Advantages", "RewardOutput", "Rollouts", "SamplingParams"]
