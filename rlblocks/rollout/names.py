"""``ENGINES``: the rollout engines a config file names (``rollout:``).

Each engine registers its class in its own module (``@ENGINES.register("hf")``), and tells the
planner how it holds memory with a ``memory_model()`` classmethod (`rlblocks.interfaces
.SizedEngine`). For config files and command lines only: code builds the engines themselves.
"""

from __future__ import annotations

from typing import Any

from rlblocks.base.registry import Registry

ENGINES: Registry[type[Any]] = Registry("rollout engine", key="rollout")
"""Name -> engine class for ``rollout:``; ``rb.plan(engine=ENGINES[name])`` sizes it."""
