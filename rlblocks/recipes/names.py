"""``RECIPES``: the recipes a config file names (``recipe:``).

Each recipe registers itself in its own module (``@RECIPES.register("grpo")``, above its other
decorators). For config files and command lines only: a notebook calls the function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlblocks.base.registry import Registry

RECIPES: Registry[Callable[..., list[dict[str, Any]]]] = Registry("recipe", key="recipe")
"""Name -> recipe for ``recipe:``; the file's other top-level keys are its keyword arguments."""
