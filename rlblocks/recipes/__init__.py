"""Recipes: short functions built only from public blocks, meant to be read and copied."""

from rlblocks.recipes.evaluate import Evaluation, evaluate
from rlblocks.recipes.grpo import grpo
from rlblocks.recipes.ppo import kl_regularized, ppo

__all__ = ["Evaluation", "evaluate", "grpo", "kl_regularized", "ppo"]
