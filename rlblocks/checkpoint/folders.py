"""Checkpoint folders on disk: written atomically, found by step, pruned.

A checkpoint of step ``s`` is the folder ``root/step-{s:08d}``. It is written as
``root/.partial-step-{s:08d}`` and becomes visible in three moves:

1. every file under the partial folder is flushed to disk (``fsync``), then the folder itself;
2. the partial folder is renamed to its final name (``os.rename``: atomic on POSIX), and
   ``root`` is fsynced so that the rename is on disk;
3. an empty ``COMPLETE`` file is written into it and fsynced, with ``root`` again.

Only a folder with its ``COMPLETE`` file counts (`complete_steps`): a kill at any moment leaves
either the previous checkpoints alone (a stale partial folder, swept on the next save) or a
renamed folder without its marker, which is ignored, then swept as well. A write that fails
(a full disk, a file size limit) removes its partial folder and raises; the checkpoints already
there are never touched until a newer one is complete.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

MARKER = "COMPLETE"
_NAME = re.compile(r"^step-(\d{8,})$")


def step_folder(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (complete or not)."""
    return root / f"step-{step:08d}"


def partial_folder(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is renamed into place."""
    return root / f".partial-step-{step:08d}"


def complete_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints under ``root``, ascending."""
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and (child / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def sweep(root: Path) -> list[Path]:
    """Remove what interrupted writes left under ``root``: partial folders and renamed folders
    without their marker. Returns the removed paths."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        stale = child.name.startswith(".partial-step-")
        stale |= bool(_NAME.match(child.name)) and not (child / MARKER).is_file()
        if stale and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def publish(partial: Path, final: Path) -> None:
    """Make the written ``partial`` folder the complete checkpoint ``final`` (module docstring)."""
    fsync_tree(partial)
    os.rename(partial, final)  # fails if ``final`` exists: callers sweep and check first
    fsync_path(final.parent)
    marker = final / MARKER
    with marker.open("w") as f:
        f.flush()
        os.fsync(f.fileno())
    fsync_path(final)


def fsync_tree(folder: Path) -> None:
    """``fsync`` every file under ``folder``, then every folder, deepest first."""
    folders = []
    for here, _, files in os.walk(folder):
        folders.append(Path(here))
        for name in files:
            fsync_path(Path(here) / name)
    for path in reversed(folders):
        fsync_path(path)


def fsync_path(path: Path) -> None:
    """Flush one file or folder to disk (a folder's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def to_prune(steps: Iterable[int], *, keep_last: int | None, keep_every: int | None) -> list[int]:
    """The steps to delete so that the newest ``keep_last`` remain (None: all), plus every step
    divisible by ``keep_every`` (None: none kept for that reason). The newest is always kept."""
    steps = sorted(steps)
    if keep_last is None:
        return []
    kept = set(steps[-max(keep_last, 1) :])
    if keep_every:
        kept |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in kept]


__all__ = [
    "MARKER",
    "complete_steps",
    "fsync_path",
    "fsync_tree",
    "partial_folder",
    "publish",
    "step_folder",
    "sweep",
    "to_prune",
]
