"""``DATA``: the prompt-dataset builders a config file names (``data.name``, ``eval.name``).

Each builder registers itself in its own module (``@DATA.register("gsm8k")``). For config files
and command lines only: code calls the builders themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlblocks.base.registry import Registry

DATA: Registry[Callable[..., Any]] = Registry("data source", key="data.name")
"""Name -> prompt-dataset builder for ``data.name``; the section's other keys are its
arguments."""
