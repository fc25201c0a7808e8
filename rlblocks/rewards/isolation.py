"""`ProcessPool`: worker processes that score `per_sample` rows and can really be stopped.

``per_sample(fn, pool=ProcessPool(workers=4))`` runs ``fn`` in worker processes instead of
threads. What that buys, over threads:

- a row past its deadline is stopped: its worker's whole process group gets SIGKILL, so a
  CPU-bound loop stops spinning and programs the row started (``sleep``, a compiler, a test
  run) die with it; a fresh worker takes the worker's place;
- a worker that dies (segfault, ``os._exit``, out of memory) fails its row, not the caller;
- ``fn`` calling ``os.fork()`` forks a worker, never the training driver, and the worker's
  fork guard makes sure only one copy of the worker answers (`rlblocks.isolation.worker`).

Design choices, and why (the worker process itself, its start, its socket, the kill and the
guards inside it, is `rlblocks.isolation`'s, shared with `rlblocks.envs.ProcessRunner`; what
is this module's is handing rows to workers and reading their outcomes):

- **fresh interpreters, not fork** (`rlblocks.isolation.process`): a forked driver would copy
  torch's thread pools, CUDA and Ray's connections into each worker; ``spawn`` and
  ``forkserver`` re-run an unguarded training script in every worker.
- **cloudpickle ships ``fn``.** Functions defined in a notebook, lambdas and closures cannot be
  pickled by reference; cloudpickle (a dependency of Ray) pickles them by value. Functions of
  importable modules still travel by reference: workers get the caller's ``sys.path``.
- **one row at a time per worker**, so that a row's clock starts when it is sent and a kill
  stops exactly one row. The clock does not count the worker's start-up or loading ``fn``
  (which may import torch): loading has its own limit, ``LOAD_LIMIT``.
- **workers live across calls** (one training step to the next), are started lazily on the
  first call, and are killed by `close` (or ``with``, or at interpreter exit, or when the
  pool is garbage collected). If the calling process is killed outright, each worker notices
  within half a second and kills its own process group.

Not a sandbox: ``fn`` runs with the caller's user, files and network, and a program that starts
its own session (``setsid``) leaves the process group and survives the kill. Programs a row
leaves running after it returns live until that worker is replaced or the pool is closed.
"""

from __future__ import annotations

import pickle
import signal
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import rlblocks.rewards.isolation_worker as handler  # the worker side of a row (rlblocks.isolation)
from rlblocks.isolation.process import LOAD_LIMIT, WorkerProcess, kill_all
from rlblocks.rewards.outcome import Failure, Outcome, checked_score

LOADING = -1  # a worker's "row" while it loads the reward function


class _Worker:
    """One worker process (`rlblocks.isolation.WorkerProcess`) and the row it is scoring."""

    def __init__(self) -> None:
        self.process = WorkerProcess(handler)
        self.conn = self.process.conn
        self.fn_bytes: bytes | None = None  # the pickled fn this worker has loaded
        self.row: int | None = None  # the row it scores, or LOADING while it loads fn
        self.deadline = float("inf")

    def send(self, message: tuple, *, row: int, limit: float | None) -> None:
        self.process.send(message)
        self.row = row
        self.deadline = float("inf") if limit is None else time.monotonic() + limit

    def kill(self) -> int:
        """Kill the worker with its process group (`WorkerProcess.kill`); its exit status."""
        return self.process.kill()


def _death_note(code: int) -> str:
    """Why a worker that closed its socket ended: its signal or exit code."""
    if code < 0:
        return f"worker process died ({signal.Signals(-code).name})"
    return f"worker process exited with code {code}"


class ProcessPool:
    """Worker processes for `per_sample`: each row runs in a process that can be killed.

    ``workers``: processes scoring rows at once (each uses one core while it runs). Workers start
    on the first call and stay alive between calls; `close` (or ``with ProcessPool() as pool``)
    kills them and everything they started. A pool pickles as its settings only, so a reward
    built on it can be sent to a Ray actor, which starts its own workers there.
    """

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(
                f"ProcessPool: workers must be >= 1, got {workers}; pass a positive count"
            )
        self.workers = workers
        self._idle: list[_Worker] = []  # every worker while no call runs; busy ones leave it
        self._lock = threading.Lock()  # one batch at a time: rows of two calls never mix
        self._closed = False
        # Kills whatever is in the list at exit or garbage collection; holds no ref to self.
        self._finalizer = weakref.finalize(self, kill_all, self._idle)

    def map(
        self, fn: Callable[..., float], completions: list[str], rows: list[dict], *,
        timeout: float | None,
    ) -> list[Outcome]:  # fmt: skip
        """Score ``fn(completions[i], **rows[i])`` for every row, each under ``timeout`` s."""
        import cloudpickle  # here, not at the top: only process mode pays for the import

        if self._closed:
            raise RuntimeError("ProcessPool: the pool is closed; create a new ProcessPool")
        try:
            fn_bytes = cloudpickle.dumps(fn)
        except Exception as e:
            raise TypeError(
                f"ProcessPool: cannot pickle the reward function ({e}); define it at module level "
                "or make what it captures picklable"
            ) from e
        load = ("load", handler.FN, fn_bytes, list(sys.path))
        with self._lock:
            return _Batch(self._idle, self.workers, load, completions, rows, timeout).run()

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers between calls (each is also its process group's id)."""
        return [w.process.pid for w in self._idle]

    def close(self) -> None:
        """Kill every worker with its process group. The pool cannot be used afterwards."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> ProcessPool:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:
        return (ProcessPool, (self.workers,))

    def __repr__(self) -> str:
        return f"ProcessPool(workers={self.workers})"


class _Batch:
    """One `ProcessPool.map` call: hand rows to workers, collect replies, enforce deadlines."""

    def __init__(
        self, idle: list[_Worker], size: int, load: tuple, completions: list[str],
        rows: list[dict], timeout: float | None,
    ) -> None:  # fmt: skip
        self.idle, self.size, self.load, self.timeout = idle, size, load, timeout
        self.completions, self.rows = completions, rows
        self.todo = deque(range(len(rows)))
        self.busy: dict[Connection, _Worker] = {}
        self.outcomes: list[Outcome | None] = [None] * len(rows)

    def run(self) -> list[Outcome]:
        try:
            while len(self.idle) < min(self.size, len(self.rows)):
                self.idle.append(_Worker())
            while self.todo or self.busy:
                self._dispatch()
                if not self.busy:
                    continue
                left = min(w.deadline for w in self.busy.values()) - time.monotonic()
                wait_s = None if left == float("inf") else max(left, 0.0)  # None: no limit
                for conn in wait(list(self.busy), timeout=wait_s):
                    self._receive(self.busy.pop(conn))  # type: ignore[call-overload]  # wait() returns items of the list it got: Connections
                self._stop_overdue()
        finally:  # an error or Ctrl-C: a worker still busy would answer into the next batch
            kill_all(list(self.busy.values()))
            self.busy.clear()
        return self.outcomes  # type: ignore[return-value]  # every row got an outcome

    def _dispatch(self) -> None:
        """Give each idle worker its next message: ``fn`` if it lacks it, else a row."""
        while self.idle and self.todo:
            worker = self.idle.pop()
            limit: float | None
            if worker.fn_bytes != self.load[2]:
                message, row, limit = self.load, LOADING, LOAD_LIMIT
            else:
                row, limit = self.todo.popleft(), self.timeout
                message = ("row", row, self.completions[row], self.rows[row])
            try:
                worker.send(message, row=row, limit=limit)
            except OSError:  # the idle worker died (killed from outside): replace it
                if row != LOADING:
                    self.todo.appendleft(row)
                worker.kill()
                self.idle.append(_Worker())
                continue
            except Exception as e:  # noqa: BLE001 -- a row whose metadata does not pickle
                self.outcomes[row] = Failure("error", f"cannot send the row: {e}", e)
                self.idle.append(worker)
                continue
            self.busy[worker.conn] = worker

    def _receive(self, worker: _Worker) -> None:
        """Read a worker's reply; a closed socket means the worker died with its row."""
        try:
            data = worker.conn.recv_bytes()
        except (EOFError, OSError):
            note = _death_note(worker.kill())
            if worker.row == LOADING:
                raise RuntimeError(
                    f"ProcessPool: {note} while loading the reward function; check that it "
                    "imports in a fresh process"
                )
            assert worker.row is not None  # a busy worker has a row
            self.outcomes[worker.row] = Failure("error", note)
            self.idle.append(_Worker())
            return
        try:
            reply = pickle.loads(data)
        except Exception as e:
            if worker.row is None or worker.row == LOADING:
                raise
            why = f"{type(e).__name__}: {e}"
            self.outcomes[worker.row] = Failure(
                "error",
                f"its result cannot be unpickled in this process ({why}); return a float",
                e,
            )
            worker.row = None
            self.idle.append(worker)
            return
        if reply[0] == "load_error":
            self.idle.append(worker)
            raise RuntimeError(
                f"ProcessPool: a worker cannot load the reward function ({reply[1]}); define it "
                "in a module the worker can import (its sys.path is the caller's)"
            )
        if reply[0] == "loaded":
            worker.fn_bytes = self.load[2]
        else:
            self.outcomes[reply[1]] = _outcome(reply)
        worker.row = None
        self.idle.append(worker)

    def _stop_overdue(self) -> None:
        """Kill every worker whose row (or load) ran past its deadline; fresh ones replace them."""
        now = time.monotonic()
        for conn, worker in list(self.busy.items()):
            if worker.deadline > now:
                continue
            del self.busy[conn]
            if worker.row == LOADING:
                worker.kill()
                raise RuntimeError(
                    f"ProcessPool: a worker took over {LOAD_LIMIT:g} s to load the reward "
                    "function; make importing it cheaper (load large state lazily)"
                )
            assert worker.row is not None  # a busy worker has a row
            self.outcomes[worker.row] = Failure("timeout", f"no result after {self.timeout:g} s")
            worker.kill()
            self.idle.append(_Worker())


def _outcome(reply: tuple) -> Outcome:
    """The `Outcome` of a worker's ``ok`` or ``error`` reply."""
    if reply[0] == "ok":
        return checked_score(reply[2])
    _, _, text, exc_bytes, tb = reply
    try:
        error = pickle.loads(exc_bytes) if exc_bytes is not None else RuntimeError(text)
    except Exception:  # noqa: BLE001 -- e.g. an exception class whose __init__ takes other args
        error = RuntimeError(text)
    if tb and hasattr(error, "add_note"):  # Python 3.11+: the worker's traceback in the report
        error.add_note(f"raised in the reward worker process:\n{tb}")
    return Failure("error", text, error)
