"""One writer per run folder: an exclusive lock file, held while a run or a tracker writes there.

Two runs on one checkpoint folder, or two trackers on one folder (a notebook cell run again
while the first tracker is still open), would mix what they write: ``metrics.jsonl`` with step 0
twice, two checkpoints of one step racing for one name. So each writer holds a lock on a file of
its own kind in the folder, the `rlblocks.checkpoint.Checkpointer` on ``.checkpointer.lock``
(for the whole run) and the `rlblocks.tracking.Tracker` on ``.tracker.lock`` (from ``start``
to ``close``), and a second writer of the same kind fails at once with `FolderInUseError`,
naming the folder, the process that holds it and what to do. Nothing ever waits for a lock.

The lock is ``filelock.FileLock``: ``flock(2)``, which the kernel drops when the holder's last
descriptor closes, so a holder that released it, was garbage collected, or died however it died
(SIGKILL included) never blocks the next one. The holder's process id is read from
``/proc/locks``, the kernel's own table of who holds which lock (Linux; elsewhere it is
"unknown"), rather than from a file the holder writes, which a killed holder would leave stale.
The lock file stays after release: deleting it would let a process that opened the old file
and one that creates a new one both "hold" the same name.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from filelock import FileLock, Timeout

P = ParamSpec("P")
R = TypeVar("R")


class FolderInUseError(RuntimeError):
    """Another run or tracker writes into this folder; the message names it and what to do."""


class FolderLock:
    """The lock of ``folder/name`` for one writer (module docstring). Re-entrant: `acquire` in
    a holder that holds it already only counts, and the lock goes when every `acquire` has
    had its `release`. ``owner`` (``"Checkpointer"``) starts the message, ``advice`` ends it.
    """

    def __init__(self, folder: str | Path, name: str, *, owner: str, advice: str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / name
        self.owner, self.advice = owner, advice
        self.existed: bool | None = None
        """Whether the lock file was there when this lock was first taken: a writer of this
        kind used the folder before (None until then)."""
        # thread_local=False: one holder per object, whichever thread releases it.
        self._lock = FileLock(str(self.path), timeout=0, thread_local=False)

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._lock.is_locked

    def acquire(self) -> None:
        """Take the lock, creating the folder if needed; `FolderInUseError` at once if another
        holder has it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        existed = self.path.exists()
        try:
            self._lock.acquire()
        except Timeout:
            raise FolderInUseError(
                f"{self.owner}: {self.folder} is in use by {holder(self.path)}; {self.advice}"
            ) from None
        if self.existed is None:
            self.existed = existed

    def release(self) -> None:
        """Give back one `acquire` (the lock itself goes with the last one)."""
        if self.held:
            self._lock.release()

    @contextmanager
    def holding(self) -> Iterator[None]:
        """``with lock.holding():`` acquire, then release however the block ends."""
        self.acquire()
        try:
            yield
        finally:
            self.release()


def locked(method: Callable[P, R]) -> Callable[P, R]:
    """A method that runs holding ``self.lock`` (a `FolderLock`), e.g. ``Checkpointer.save``."""

    @functools.wraps(method)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        self: Any = args[0]
        with self.lock.holding():
            return method(*args, **kwargs)

    return run


def holder(path: Path) -> str:
    """Who holds the lock on ``path``, in words: ``process 1234 (python -m rlblocks.app.train
    run.yaml)``, ``this process (pid 1234)``, or ``another process (its id unknown)``."""
    pid = locking_pid(path)
    if pid is None:
        return "another process (its id unknown)"
    if pid == os.getpid():
        return f"this process (pid {pid}): another object here still holds it"
    command = _command_line(pid)
    return f"process {pid}" + (f" ({command})" if command else "")


def locking_pid(path: Path) -> int | None:
    """The id of the process holding a ``flock`` on ``path``, from ``/proc/locks`` (Linux);
    None where that table is missing or does not list the file."""
    try:
        st = os.stat(path)
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    # A row: "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2474411 0 EOF" (device numbers in hex).
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for row in table.splitlines():
        fields = row.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device:
            return int(fields[4]) if fields[4].isdigit() and int(fields[4]) > 0 else None
    return None


def _command_line(pid: int) -> str:
    """The command line of process ``pid`` (Linux), at most 120 characters; "" if unknown."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return text if len(text) <= 120 else text[:117] + "..."


__all__ = ["FolderInUseError", "FolderLock", "holder", "locked", "locking_pid"]
