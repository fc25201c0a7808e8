"""``REWARDS``: the ready-made reward functions a config file names (``reward:``).

Each registers itself where it is built (``math_answer`` in ``math.py``). For config files and
command lines only (every entry takes a `Rollouts`); code passes the functions themselves.
"""

from __future__ import annotations

from rlblocks.base.registry import Registry
from rlblocks.interfaces import RewardFn

REWARDS: Registry[RewardFn] = Registry("reward", key="reward")
"""Name -> reward function for ``reward:`` (else ``package.module:function``)."""
