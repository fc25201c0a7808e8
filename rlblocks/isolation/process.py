"""The caller's side of `rlblocks.isolation`: start a worker process in a session of its own,
send it messages, and kill it with everything it started.

Design choices, shared by `rlblocks.envs.ProcessRunner` and `rlblocks.rewards.ProcessPool`, and
why:

- **fresh interpreters, not fork.** A worker is started by `subprocess.Popen` (fork + exec at
  once) with ``start_new_session=True``, so that its process group is its own to kill: SIGKILL
  for the group stops a spinning loop and the programs it started (``sleep``, a compiler, a
  test run). Forking the caller (multiprocessing's ``fork``) would copy torch's thread pools,
  CUDA and Ray's connections into each worker, which deadlocks or corrupts them; ``spawn`` and
  ``forkserver`` re-import the user's ``__main__`` script, which runs an unguarded training
  script once more in every worker.
- **a bootstrap, not ``-m``.** ``python -m rlblocks...`` would import the rlblocks package
  (torch with it, seconds per worker); ``python file.py`` would put the file's folder first on
  ``sys.path`` (rlblocks/rewards/math.py would shadow the standard library's). ``BOOTSTRAP``
  loads `rlblocks.isolation.worker` by name from its file instead, and the worker loads the
  caller's handler module the same way (`rlblocks.isolation.worker`).
- **a socket pair** carries the messages (`multiprocessing.connection.Connection` framing);
  the worker's end is passed by file descriptor and closed here at once, so that the socket
  reads end-of-file when the worker dies.

A worker outlives nothing: `kill` at the caller's will, a finalizer of the caller's at exit or
garbage collection, and the worker's own watchdog when the caller's process is gone.

Not a sandbox: the functions run with the caller's user, files and network. A program that
starts its own session (``setsid``) leaves the process group, but not the worker's descendants:
on Linux the worker is the subreaper of everything below it, and `WorkerProcess.kill` (and the
worker itself, when its caller closes the socket or dies) SIGKILLs every descendant found in
``/proc`` before the group. A program that escapes to another user or a container is beyond
it (the code sandbox, `rlblocks.rewards.sandbox`, is for untrusted code).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from socket import socketpair
from types import ModuleType
from typing import Protocol, TypeVar

from rlblocks.isolation.worker import kill_descendants

LOAD_LIMIT = 120.0  # seconds a worker may take to load a function (its imports included)
WORKER_SCRIPT = Path(__file__).with_name("worker.py")
# `python -c` this with: worker.py, the handler's module name and file, the socket's fd. It
# loads worker.py as rlblocks.isolation.worker without importing the rlblocks package.
BOOTSTRAP = (
    "import importlib.util as u, sys; "
    "spec = u.spec_from_file_location('rlblocks.isolation.worker', sys.argv[1]); "
    "worker = sys.modules[spec.name] = u.module_from_spec(spec); "
    "spec.loader.exec_module(worker); worker.main(*sys.argv[2:])"
)


def worker_command(handler: ModuleType) -> list[str]:
    """The command line of a worker that ``handler`` serves, all but the socket's fd (its last
    argument)."""
    assert handler.__file__ is not None  # a handler is a module file (rlblocks.isolation.worker)
    return [sys.executable, "-u", "-c", BOOTSTRAP, str(WORKER_SCRIPT), handler.__name__,
            handler.__file__]  # fmt: skip


class WorkerProcess:
    """One worker process that ``handler`` serves (`rlblocks.isolation.worker`), in its own
    session and process group, and the caller's end of its socket."""

    def __init__(self, handler: ModuleType) -> None:
        ours, theirs = socketpair()
        self.proc = subprocess.Popen(
            [*worker_command(handler), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killpg reaches its children too
        )
        theirs.close()
        self.conn = Connection(ours.detach())

    @property
    def pid(self) -> int:
        """The worker's process id, also its process group's."""
        return self.proc.pid

    def send(self, message: tuple | bytes) -> None:
        """Send ``message``, pickled here unless it is already; raises ``OSError`` if the worker
        is gone, and what pickle raises for a message that cannot be pickled."""
        self.conn.send_bytes(message if isinstance(message, bytes) else pickle.dumps(message))

    def kill(self) -> int:
        """SIGKILL the worker's whole process group, reap the worker, return its exit status.

        The group is killed before the worker is reaped, so its id (the worker's pid) cannot
        have been reused by an unrelated process; a worker already reaped (it died and was
        polled) keeps its status and its group is left alone, for the same reason. A worker
        that exited by itself keeps its status too: SIGKILL does not change a process that is
        already exiting.
        """
        if self.proc.returncode is None:
            # The programs a call started in sessions of their own first (setsid): the worker
            # is their subreaper (rlblocks.isolation.worker), so they are found below it.
            kill_descendants(self.proc.pid)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # the group is already empty
                pass
        code = self.proc.wait()
        self.conn.close()
        return code


class Killable(Protocol):
    """What `kill_all` stops: a `WorkerProcess`, or a caller's record that holds one."""

    def kill(self) -> int:
        """Kill it and everything it started; its exit status."""
        ...


K = TypeVar("K", bound=Killable)


def kill_all(workers: list[K]) -> None:
    """Kill every worker in ``workers`` and empty the list (a finalizer's job: the list is the
    caller's live one, so that the finalizer holds no reference to the caller itself)."""
    while workers:
        workers.pop().kill()
