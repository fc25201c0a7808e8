"""The process table read from /proc, for tests that check that no process outlives them."""

from __future__ import annotations

from pathlib import Path


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) for every process, read from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # the name field may hold spaces and parentheses: split after the last ")"
                state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue  # exited while we read
            table[int(entry.name)] = (int(ppid), state)
    return table


def live_descendants(root: int) -> set[int]:
    """Processes below ``root`` that are not zombies."""
    table, found, frontier = processes(), set(), [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in table.items() if ppid == parent]
        found.update(pid for pid in children if table[pid][1] not in "ZX")
        frontier += children
    return found
