"""``ESTIMATORS``: the advantage estimators a config file names (``advantage.name``).

Each estimator registers itself in its own module (``@ESTIMATORS.register("grpo")``); a
variant registers its ``partial`` beside the function (``dr_grpo`` in ``grpo.py``). For config
files and command lines only: code passes the functions themselves.
"""

from __future__ import annotations

from collections.abc import Callable

from rlblocks.base.registry import Registry
from rlblocks.interfaces import Advantages

ESTIMATORS: Registry[Callable[..., Advantages]] = Registry(
    "advantage estimator", key="advantage.name"
)
"""Name -> advantage estimator, for ``advantage.name``; the section's other keys are its
keyword arguments."""
