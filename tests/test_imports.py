"""The package's import graph: no import circle, and no block imports the notebook package.

Every ``import`` and ``from ... import`` in rlblocks/ counts, including those inside functions
(a lazy import still ties the two modules together) and under ``TYPE_CHECKING``. An edge goes to
the module named (``from rlblocks.data import length`` names ``rlblocks.data.length``), not to
the parent packages Python also runs on the way.
"""

import ast
from pathlib import Path

import rlblocks

ROOT = Path(rlblocks.__file__).parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the rlblocks modules it imports."""
    modules = module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets |= {f"{base}.{alias.name}" for alias in node.names} | {base}
        # A name resolves to the longest module prefix: rlblocks.data.length.x -> ...length.
        resolved = set()
        for target in targets:
            parts = target.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and parts[0] == "rlblocks":
                resolved.add(".".join(parts))
        graph[name] = resolved - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_circle():
    assert find_cycle(import_graph()) is None


def test_find_cycle_sees_a_circle():
    # The negative control: the search does report a circle when there is one.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_blocks_do_not_import_the_notebook_package():
    # The dashboard and plots read the blocks (runlog's JSONL); a block never reads them back.
    edge = {"rlblocks", "rlblocks.app.demo"}  # the package's lazy rb.plot, and the demo program
    offenders = {
        name: sorted(t for t in targets if t.startswith("rlblocks.notebook"))
        for name, targets in import_graph().items()
        if name not in edge and not name.startswith("rlblocks.notebook")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
