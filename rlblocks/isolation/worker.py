"""The child's side of `rlblocks.isolation`: the loop a worker process runs, and its guards.

`rlblocks.isolation.process.WorkerProcess` starts a fresh interpreter on this file through its
``BOOTSTRAP``, which loads it as ``rlblocks.isolation.worker`` straight from its file: the
rlblocks package itself (whose ``__init__`` imports torch) is never imported, so nothing of the
caller's process (torch thread pools, Ray connections, CUDA state) is copied into the worker.
This module imports only the standard library; so must the *handler*, the module of the caller
(`rlblocks.envs.tool_worker`, `rlblocks.rewards.isolation_worker`) that says what a message
means. The handler is loaded the same way, by its package name from its file, so that it can
import this module by name (``from rlblocks.isolation.worker import describe``) and still not
run a package ``__init__``.

Messages travel in `multiprocessing.connection.Connection` framing. Each message to the worker
is a pickled tuple; each reply is bytes that the handler encodes (JSON for tool calls, so that
nothing a tool writes can run code in the caller; pickle for reward rows). One message is the
same for every handler, and this loop answers it::

    caller -> worker  ("load", key, fn_bytes, sys_path)   worker -> caller  ("loaded",) | ("load_error", text)

``fn_bytes`` (a cloudpickled function) is unpickled with the caller's ``sys.path``, so that a
function pickled by reference imports its module as the caller would, and kept under ``key``;
every other message goes to ``handler.handle(message, loaded)``, which returns the encoded
reply, and ``handler.encode(reply)`` encodes the load replies.

Three guards live here, not in the caller, because they must run inside the worker:

- fork guard: a process that is not the worker itself (the function called ``os.fork()`` and
  the child came back out of it) exits at once with ``os._exit``: it never reads the next
  message nor writes a second reply;
- zombies: children of the worker that already exited are reaped after every reply;
- parent watchdog: when the caller's process dies (even by SIGKILL, which runs no clean-up)
  the worker kills its whole process group, so that nothing keeps running for a process that is
  gone.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

WATCH_INTERVAL = 0.5  # seconds between two checks that the caller's process is still alive


def main(handler_name: str, handler_file: str, fd: str) -> None:
    """The worker process: load the handler module, then serve messages on socket ``fd``."""
    become_subreaper()
    handler = load_file(handler_name, handler_file)
    try:
        serve(int(fd), handler.handle, handler.encode)
    finally:
        kill_descendants(os.getpid())  # the caller is done: nothing a call started lives on


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Linux: make this process the parent of every orphan among its descendants, so that a
    program a call started in its own session (``setsid``, a double fork) stays findable under
    it (`descendants`) instead of being handed to init. Elsewhere: nothing."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(root: int) -> list[int]:
    """The live processes below ``root`` (children, theirs, ...), from ``/proc``; empty where
    there is none. Zombies are left out: they are gone already, their parent reaps them."""
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields and fields[0] not in (b"Z", b"X"):
            parents[int(entry)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        here = frontier.pop()
        kids = [pid for pid, ppid in parents.items() if ppid == here]
        found += kids
        frontier += kids
    return found


def kill_descendants(root: int, rounds: int = 20) -> None:
    """SIGKILL every live process below ``root``, in whatever session or group, again until
    none is left (one may fork while the others are killed); at most ``rounds`` passes."""
    for _ in range(rounds):
        alive = descendants(root)
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def load_file(name: str, file: str) -> ModuleType:
    """Import the module at ``file`` as ``name`` without importing the packages above it."""
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None  # a .py file always has both
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so that what it pickles, or what imports it, finds it by name
    spec.loader.exec_module(module)
    return module


def serve(
    fd: int,
    handle: Callable[[tuple, dict[int, Any]], bytes],
    encode: Callable[[tuple], bytes],
) -> None:
    """Answer messages on socket ``fd`` until the caller closes its end (module docstring)."""
    os.set_inheritable(fd, False)  # programs that a function starts must not hold the socket
    conn = Connection(fd)
    me, parent = os.getpid(), os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    loaded: dict[int, Any] = {}
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the caller closed the socket or its process is gone
        try:
            if message[0] == "load":
                reply = encode(_load(loaded, *message[1:]))
            else:
                reply = handle(message, loaded)
        finally:
            if os.getpid() != me:  # a child forked inside the function came back: it must exit
                os._exit(0)
        conn.send_bytes(reply)
        _reap_children()


def describe(error: BaseException) -> str:
    """``"<type>: <message>"`` of an exception whose ``__str__`` may itself raise."""
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - an exception class with a broken __str__
        message = "(its message cannot be shown)"
    return f"{type(error).__name__}: {message}"


def _load(loaded: dict[int, Any], key: int, fn_bytes: bytes, sys_path: list[str]) -> tuple:
    """Unpickle a function with the caller's ``sys.path`` (so by-reference imports work)."""
    sys.path[:] = sys_path
    try:
        loaded[key] = pickle.loads(fn_bytes)
    except BaseException as error:  # noqa: BLE001 - reported to the caller, which raises it
        return ("load_error", f"{describe(error)}\n{traceback.format_exc()}")
    return ("loaded",)


def _reap_children() -> None:
    """Collect children of the worker that already exited, so they do not stay as zombies."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _watch_parent(parent: int) -> None:
    """Kill this worker's process group once the caller's process is gone (re-parented)."""
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL)
    kill_descendants(os.getpid())  # those that left the group too (setsid)
    os.killpg(os.getpgid(0), signal.SIGKILL)
