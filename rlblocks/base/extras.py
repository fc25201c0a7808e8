"""Optional dependencies: each lives in an extra of the package (``pip install "rlblocks[ray]"``).

The core install (torch, transformers, peft, datasets) runs every block in one process. The
parts below need more, and import it only when used; when it is missing, :func:`require` says
which extra brings it instead of a bare ``ModuleNotFoundError`` from deep inside a call.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

#: The extra of ``pyproject.toml`` that brings each optional top-level module.
EXTRAS: dict[str, str] = {
    "ray": "ray",
    "matplotlib": "plot",
    "ipywidgets": "notebook",
    "IPython": "notebook",
    "math_verify": "math",
    "pandas": "pandas",
    "vllm": "vllm",
}


def require(module: str, *, extra: str | None = None, needed_by: str = "this") -> ModuleType:
    """Import ``module`` or raise an ImportError naming the extra that installs it.

    ``extra`` defaults to :data:`EXTRAS` of the module's top-level package; ``needed_by`` names
    the block that asked, for the message.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.partition(".")[0]
        extra = extra or EXTRAS.get(top)
        how = f'pip install "rlblocks[{extra}]"' if extra else f"pip install {top}"
        raise ImportError(
            f"{needed_by}: needs {top!r}, which is not installed ({error}); {how}"
        ) from error


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent missing, or sys.modules[module] is None
        return False
