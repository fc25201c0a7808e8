"""``LOSSES`` and ``PREFERENCES``: the losses a config file names (``loss.name``,
``preference.name``).

Each loss registers itself in its own module (``@LOSSES.register("gspo")``). For config files
and command lines only: code passes the functions themselves. The reductions' names are
`rlblocks.losses.aggregate.AGGREGATIONS`, the off-policy corrections'
`rlblocks.losses.offpolicy.CORRECTIONS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlblocks.base.registry import Registry

LOSSES: Registry[Callable[..., Any]] = Registry("policy loss", key="loss.name")
"""Name -> policy loss for ``loss.name``; the section's other keys are its keyword arguments."""

PREFERENCES: Registry[Callable[..., Any]] = Registry("preference loss", key="preference.name")
"""Name -> pair loss for ``preference.name`` (online DPO); the other keys are its keywords."""
