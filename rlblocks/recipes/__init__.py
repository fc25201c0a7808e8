"""Recipes: short functions built only from public blocks, meant to be read and copied.

A recipe holds its algorithm: the blocks, the algorithm's hyperparameters, and ``run=`` (a
`rlblocks.run.RunOptions`). Each is one ``for`` loop driven by a `rlblocks.run.Run` (progress,
the metrics every recipe reports, ``on_step``, checkpoints, resume) over a
`rlblocks.run.RolloutSource` (where rollouts and π_old come from), written once in its own
file: the README's cell is `rlblocks.recipes.grpo`'s body. `rlblocks.recipes.defaults` holds
the defaults they share.
``kl_regularized`` lives in `rlblocks.losses` and is re-exported here. ``RECIPES`` names the
recipes a config file picks (``recipe: grpo``); each registers itself beside its definition.
"""

from rlblocks.losses import kl_regularized
from rlblocks.recipes.dapo import InformativeGroups, dapo, sample_informative_groups
from rlblocks.recipes.distill import distill
from rlblocks.recipes.evaluate import Evaluation, evaluate
from rlblocks.recipes.grpo import grpo
from rlblocks.recipes.names import RECIPES
from rlblocks.recipes.online_dpo import online_dpo
from rlblocks.recipes.ppo import ppo
from rlblocks.recipes.sft import held_out_nll, sft
from rlblocks.recipes.variants import greedy_baseline_rewards, remax, with_greedy_answers

__all__ = [
    "RECIPES",
    "Evaluation",
    "InformativeGroups",
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
    "with_greedy_answers",
]
