"""Advantage estimators: pure functions ``(rewards, mask, group_ids, /, *, ...) -> Advantages``.

Every estimator follows docs/conventions.md: ``rewards`` is ``(b)`` or ``(b t)``, ``mask`` is
``(b t)`` bool, ``group_ids`` ``(b)`` int64 with arbitrary ids; the result is
``Advantages(advantages, returns)``, both ``(b t)`` float32, zero where ``mask`` is False, and
detached. Variants are ``functools.partial``s: ``partial(grpo, scale_by_std=False)`` is Dr.GRPO.

``ESTIMATORS`` (`rlblocks.advantage.names`) maps a name to an estimator for config files and
CLIs only; each estimator registers itself beside its definition. Code imports the function.
"""

from __future__ import annotations

from rlblocks.advantage.distill import teacher_kl
from rlblocks.advantage.gae import gae
from rlblocks.advantage.gpg import gpg
from rlblocks.advantage.groups import (
    group_index,
    group_max,
    group_mean,
    group_min,
    group_size,
    group_std,
    group_sum,
)
from rlblocks.advantage.grpo import grpo
from rlblocks.advantage.names import ESTIMATORS
from rlblocks.advantage.opo import opo
from rlblocks.advantage.passk import grpo_passk
from rlblocks.advantage.reinforce_pp import reinforce_pp, reinforce_pp_baseline
from rlblocks.advantage.remax import remax
from rlblocks.advantage.returns import discounted_returns, outcome_scores, token_rewards
from rlblocks.advantage.rloo import rloo
from rlblocks.advantage.whiten import whiten
from rlblocks.interfaces import Advantages

__all__ = [
    "ESTIMATORS",
    "Advantages",
    "discounted_returns",
    "gae",
    "gpg",
    "group_index",
    "group_max",
    "group_mean",
    "group_min",
    "group_size",
    "group_std",
    "group_sum",
    "grpo",
    "grpo_passk",
    "opo",
    "outcome_scores",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "teacher_kl",
    "token_rewards",
    "whiten",
]
