"""Python stacks of this process and of others on this machine, for stall reports.

`thread_stacks` formats every thread of this process. `serve_stacks` makes a process write
every thread's stack when it receives a signal (``faulthandler``: from C, so that a thread
blocked inside C code, a collective or a sleep, still answers), into a file no other process
can see by name: an unlinked temporary file, read through ``/proc/<pid>/fd``. Nothing is left
behind in the temporary folder. `SignalStacks` is the other side: it signals the process and
reads what it wrote. Both processes must be on one machine and belong to one user.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO


def thread_stacks(*, first: int | None = None) -> str:
    """Every thread of this process with its Python stack, thread ``first`` (an ident) first;
    the calling thread (the watchdog's own) left out."""
    frames = sys._current_frames()
    frames.pop(threading.get_ident(), None)
    names = {t.ident: t.name for t in threading.enumerate()}
    order = sorted(frames, key=lambda ident: (ident != first, names.get(ident, "")))
    parts = []
    for ident in order:
        stack = "".join(traceback.format_stack(frames[ident]))
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n{stack}')
    return "\n".join(parts)


_SERVED: list[tuple[IO[str], str]] = []  # the files serve_stacks keeps open for faulthandler


def serve_stacks(signum: int = signal.SIGUSR1) -> str:
    """Make this process write every thread's Python stack when it receives ``signum``;
    returns the path another process reads them from (module docstring). Call it once at the
    start of a worker process; a second call returns the first one's path."""
    if _SERVED:
        return _SERVED[0][1]
    file = tempfile.TemporaryFile(mode="w+", prefix="rlblocks-stacks-")  # noqa: SIM115 - kept
    path = f"/proc/{os.getpid()}/fd/{file.fileno()}"
    _SERVED.append((file, path))
    faulthandler.register(signum, file=file, all_threads=True, chain=False)
    return path


class SignalStacks:
    """A `Worker` on this machine that runs `serve_stacks`: ``stacks()`` signals it and
    reads what it wrote."""

    def __init__(self, pid: int, path: str | Path, *, signum: int = signal.SIGUSR1,
                 timeout: float = 5.0) -> None:  # fmt: skip
        self.pid, self.path, self.signum, self.timeout = pid, Path(path), signum, timeout

    def stacks(self) -> str:
        """Signal the process and return what it wrote: every thread's stack (or a line
        saying it wrote nothing within ``timeout`` seconds)."""
        before = self.path.stat().st_size if self.path.exists() else 0
        os.kill(self.pid, self.signum)
        deadline, last = time.monotonic() + self.timeout, -1
        while time.monotonic() < deadline:
            time.sleep(0.1)
            size = self.path.stat().st_size if self.path.exists() else 0
            if size > before and size == last:  # written and no longer growing
                break
            last = size
        with open(self.path, "rb") as file:
            file.seek(before)
            text = file.read().decode(errors="replace")
        return text or f"(pid {self.pid} wrote no stacks within {self.timeout:g} s)"
