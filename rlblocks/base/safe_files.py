"""Reading files a program did not write itself, without trusting their shape.

A checkpoint folder can be copied, edited or damaged by anything. What it lists is checked for
its *kind* before it is opened (a FIFO or a link to ``/dev/zero`` would block or never end a
read), its *size* before it is read, and its JSON for *depth* and *numbers* while it is parsed
(``Infinity`` and ``NaN`` are no JSON; a thousand nested lists exhaust the parser's stack). Each
failure is an `UnsafeFile` (a ``ValueError``) naming the file and what is wrong with it, so that
callers can skip the file, as the checkpointer skips a damaged checkpoint for an older one.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 64 << 20
"""The largest JSON file read (64 MiB: a manifest, a state tree, a checkpoint's meta)."""

MAX_DEPTH = 64
"""The deepest nesting of lists and objects a JSON file may have."""


class UnsafeFile(ValueError):
    """A file that is not what it must be: its kind, its size or its content."""


def regular_file(path: str | Path) -> os.stat_result:
    """``path``'s own ``lstat`` when it is a regular file (not a link, FIFO, socket or device:
    reading those can block for ever or never end); else `UnsafeFile`."""
    path = Path(path)
    try:
        status = os.lstat(path)
    except OSError as err:
        raise UnsafeFile(f"{path}: cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(status.st_mode):
        kind = _kind(status.st_mode)
        raise UnsafeFile(f"{path}: a {kind}, not a regular file; it is not read")
    return status


def read_json(
    path: str | Path, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_DEPTH
) -> Any:
    """The JSON document in ``path`` after `regular_file`, at most ``max_bytes`` long, nested at
    most ``max_depth`` deep, with no ``NaN``/``Infinity``; else `UnsafeFile` naming the file."""
    path = Path(path)
    size = regular_file(path).st_size
    if size > max_bytes:
        raise UnsafeFile(f"{path}: {size} bytes, more than the {max_bytes} a JSON file may have")
    try:
        with path.open("rb") as f:
            text = f.read(max_bytes + 1).decode("utf-8")
        document = json.loads(text, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, UnsafeFile) as err:
        why = f"{type(err).__name__}: {str(err)[:200]}" if not isinstance(err, UnsafeFile) else err
        raise UnsafeFile(f"{path}: not a JSON document this program reads ({why})") from None
    depth = _depth(document)
    if depth > max_depth:
        raise UnsafeFile(f"{path}: nested {depth} deep, more than the {max_depth} allowed")
    return document


def _no_constant(name: str) -> Any:
    raise UnsafeFile(f"{name} is not a JSON number")


def _depth(document: Any) -> int:
    """The nesting depth of lists and objects, without recursion."""
    deepest, stack = 0, [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "symbolic link"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISDIR, "folder"),
    ):
        if test(mode):
            return name
    return "special file"


__all__ = ["MAX_DEPTH", "MAX_JSON_BYTES", "UnsafeFile", "read_json", "regular_file"]
