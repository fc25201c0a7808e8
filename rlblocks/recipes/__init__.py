"""Recipes: short functions built only from public blocks, meant to be read and copied.

Each recipe is its own step function; `rlblocks.recipes.loop` runs it (progress, the metrics
every recipe reports, ``on_step``), `rlblocks.recipes.defaults` holds what they share.
``kl_regularized`` lives in `rlblocks.losses` and is re-exported here.
"""

from rlblocks.losses import kl_regularized
from rlblocks.recipes.dapo import InformativeGroups, dapo, sample_informative_groups
from rlblocks.recipes.distill import distill
from rlblocks.recipes.evaluate import Evaluation, evaluate
from rlblocks.recipes.grpo import grpo
from rlblocks.recipes.online_dpo import online_dpo
from rlblocks.recipes.overlap import OneStepOff
from rlblocks.recipes.ppo import ppo
from rlblocks.recipes.sft import held_out_nll, sft
from rlblocks.recipes.variants import greedy_baseline_rewards, remax

__all__ = [
    "Evaluation",
    "InformativeGroups",
    "OneStepOff",
    "dapo",
    "distill",
    "evaluate",
    "greedy_baseline_rewards",
    "grpo",
    "held_out_nll",
    "kl_regularized",
    "online_dpo",
    "ppo",
    "remax",
    "sample_informative_groups",
    "sft",
]
