"""YAML for the CLI's configuration files (`rlblocks.app.train`), read strictly: a key given twice
in one mapping is an error that names the key and both lines.

YAML 1.2 says mapping keys are unique, but PyYAML (and with it jsonargparse, OmegaConf and most
YAML readers) keeps the *last* value of a repeated key without a word: a config with ``lr:
1.0e-5`` under ``trainer:`` and, forty lines down in a pasted block, ``lr: 1.0e-3`` trains at
1e-3, and the saved ``config.yaml`` says so as if that had been asked. So the text is composed
first (PyYAML's node graph, which keeps every key and its line) and each mapping's keys are
compared before the value is loaded. Merge keys (``<<: *defaults``) are YAML's way to override
on purpose and are not counted.

Kept on PyYAML, which the CLI already needs (ruamel.yaml refuses duplicate keys itself, but it
would be a second YAML library for this one check). `MODE` is this loader registered with
jsonargparse (``ArgumentParser(parser_mode=MODE)``), so that a file given as ``--config`` and a
mapping given on the command line are checked too; jsonargparse's own ``yaml`` mode, which other
code in the process may use, is left as it is.
"""

from __future__ import annotations

from typing import Any

import yaml
from jsonargparse import get_loader, set_loader

__all__ = ["MODE", "DuplicateKeyError", "check_unique_keys", "load"]

_MERGE = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of a YAML text gives one key twice; ``line`` is the second one's (1-based)."""

    def __init__(self, key: str, first: int, line: int) -> None:
        super().__init__(
            f"{key} is given twice (first at line {first}); YAML would keep only the last value, "
            "without a word: remove one of them"
        )
        self.key, self.first, self.line = key, first, line


def check_unique_keys(text: str) -> None:
    """Raise `DuplicateKeyError` for the first mapping of ``text`` that repeats a key (module
    docstring); a YAML syntax error is PyYAML's ``yaml.YAMLError``, as when loading."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        _walk(root, "", set())


def _walk(node: yaml.Node, path: str, seen: set[int]) -> None:
    """Check ``node`` and everything under it; ``path``: its dotted key (``trainer.lr``)."""
    if id(node) in seen:  # an alias: the anchored node was checked where it was defined
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, f"{path}[{i}]", seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if key.tag == _MERGE:
                continue
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            dotted = f"{path}.{name}" if path else str(name)
            if name is not None:
                line = key.start_mark.line + 1
                if (key.tag, name) in lines:
                    raise DuplicateKeyError(dotted, lines[key.tag, name], line)
                lines[key.tag, name] = line
            _walk(value, dotted, seen)


_YAML = get_loader("yaml")  # jsonargparse's own: its float and timestamp rules kept


def load(text: str) -> Any:
    """jsonargparse's YAML loading of ``text``, after `check_unique_keys`."""
    check_unique_keys(text)
    return _YAML(text)


#: The jsonargparse parser mode that reads YAML with `load`.
MODE = "rlblocks_yaml"
set_loader(MODE, load, exceptions=(yaml.YAMLError,))
