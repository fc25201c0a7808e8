"""The worker process of `rlblocks.rewards.isolation.ProcessPool`: score rows sent over a socket.

Started by the pool as a fresh interpreter (``python -c`` running this file through
`runpy.run_path`, in its own session and process group), so nothing of the caller's process
(torch thread pools, Ray connections, CUDA state) is copied into it. It imports only the
standard library: the reward function arrives pickled by cloudpickle and imports what it needs
when it is unpickled.

Messages, each one pickled tuple (`multiprocessing.connection.Connection` framing):

    pool -> worker   ("load", fn_bytes, sys_path)       worker -> pool   ("loaded",) | ("load_error", text)
    pool -> worker   ("row", i, completion, row)        worker -> pool   ("ok", i, value)
                                                                         | ("error", i, text, exc_bytes, traceback)

Two guards live here, not in the pool, because they must run inside the worker:

- fork guard: a process that is not the worker itself (``fn`` called ``os.fork()`` and the
  child came back out of ``fn``) exits at once with ``os._exit``: it never reads the next row
  nor writes a second reply;
- parent watchdog: when the pool's process dies (even by SIGKILL, which runs no clean-up) the
  worker kills its whole process group, so that no row keeps running for a process that is gone.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

WATCH_INTERVAL = 0.5  # seconds between two checks that the pool's process is still alive


def main(fd: int) -> None:
    """Serve rows until the pool closes its end of the socket."""
    os.set_inheritable(fd, False)  # programs that fn starts must not hold the pool's socket
    conn = Connection(fd)
    me, parent = os.getpid(), os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    fn = None
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the pool closed the socket or its process is gone
        if message[0] == "load":
            fn, reply = _load(message[1], message[2])
        else:
            _, i, completion, row = message
            reply = _score(fn, i, completion, row, me)
        conn.send_bytes(reply)
        _reap_children()


def _load(fn_bytes: bytes, sys_path: list[str]) -> tuple[Any, bytes]:
    """Unpickle the reward function with the pool's ``sys.path`` (so by-reference imports work)."""
    sys.path[:] = sys_path
    try:
        return pickle.loads(fn_bytes), pickle.dumps(("loaded",))
    except BaseException as e:  # noqa: BLE001 -- reported to the pool, which raises it
        text = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        return None, pickle.dumps(("load_error", text))


def _score(fn: Any, i: int, completion: str, row: dict, me: int) -> bytes:
    """Call ``fn`` on one row; the reply is pickled here so an unpicklable result is a failure."""
    try:
        value = fn(completion, **row)
        try:
            return pickle.dumps(("ok", i, value))
        except Exception:  # noqa: BLE001 -- any object fn returns; the pool reports the row
            return _error(i, f"returned {type(value).__name__}, which cannot be pickled", None)
    except BaseException as e:  # noqa: BLE001 -- SystemExit from fn included: the row fails
        return _error(i, f"{type(e).__name__}: {e}", e)
    finally:
        if os.getpid() != me:  # a child forked inside fn came back: it must not become a worker
            os._exit(0)


def _error(i: int, text: str, error: BaseException | None) -> bytes:
    """An error reply; the exception travels too when it pickles (for ``raise_errors``)."""
    tb = traceback.format_exc() if error is not None else ""
    try:
        exc_bytes = pickle.dumps(error) if error is not None else None
    except Exception:  # noqa: BLE001 -- an exception holding unpicklable state: text only
        exc_bytes = None
    return pickle.dumps(("error", i, text, exc_bytes, tb))


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
    """Kill this worker's process group once the pool's process is gone (we were re-parented)."""
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL)
    os.killpg(os.getpgid(0), signal.SIGKILL)


if __name__ == "__main__":
    main(int(sys.argv[1]))
