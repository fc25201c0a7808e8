"""Every public module, function, class, method and property of rlblocks has a docstring.

The API reference (docs/api/, mkdocstrings) is generated from them, so an undocumented public
name is a hole in the reference. Public: a name without a leading underscore, defined in a
module whose dotted path has no part with one. Modules behind an extra that is not installed
are skipped (the wheel check in CI imports them where they can be).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType

import rlblocks
from rlblocks.base.extras import EXTRAS


def public_modules() -> list[ModuleType]:
    modules = [rlblocks]
    for info in pkgutil.walk_packages(rlblocks.__path__, prefix="rlblocks."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError as error:  # an optional dependency: only those may be missing
            assert (error.name or "").partition(".")[0] in EXTRAS, error
    return modules


def undocumented(module: ModuleType) -> list[str]:
    missing = [] if (module.__doc__ or "").strip() else [module.__name__]
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue  # private, or imported from elsewhere (checked where it is defined)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if not (obj.__doc__ or "").strip():
            missing.append(f"{module.__name__}.{name}")
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(member, property):
                    member = member.fget
                member = getattr(member, "__func__", member)  # classmethod, staticmethod
                if inspect.isfunction(member) and not (member.__doc__ or "").strip():
                    missing.append(f"{module.__name__}.{name}.{attr}")
    return missing


def test_every_public_name_has_a_docstring():
    missing = [name for module in public_modules() for name in undocumented(module)]
    assert not missing, f"{len(missing)} public names without a docstring: {missing}"


def test_the_check_sees_a_missing_docstring():
    module = ModuleType("rlblocks.fake", "A module.")

    def documented() -> None:
        """Yes."""

    def bare() -> None:
        pass

    class Thing:
        """A class."""

        def method(self) -> None:
            pass

        @property
        def value(self) -> int:
            return 1

    for obj in (documented, bare, Thing):
        obj.__module__ = module.__name__
        setattr(module, obj.__name__, obj)
    assert undocumented(module) == [
        "rlblocks.fake.bare",
        "rlblocks.fake.Thing.method",
        "rlblocks.fake.Thing.value",
    ]
