"""Where a tool call runs: `ProcessRunner` (the default: a worker process a time limit kills) or
`ThreadRunner` (a thread of this process, which nothing can stop).

Both do the same with a call (`rlblocks.envs.tool_worker.run`: the value as text, cut to a
size, never raising) and answer ``(text, ok)``; they differ in what a call past its time limit
leaves behind.

**`ProcessRunner`.** One worker process per runner (so per `ToolEnv`), started on the first
call by `subprocess.Popen` as a fresh interpreter in its own session, and kept for the calls
after it; calls run one at a time. A call past its limit gets SIGKILL for the worker's whole
process group (the tool and any program it started), is answered ``"Error: ... did not
finish"``, and the next call starts a fresh worker. When a call's answer comes back, its
process is gone: nothing of a timed-out call outlives it (a program that a call which did
return left running lives on until the worker is replaced or the runner closed). A worker
that dies (a segfault, ``os._exit``) fails its call, not the caller. The worker process itself (no
``fork`` of the training process, no ``spawn``; its start, its socket, the kill, the guards
inside it) is `rlblocks.isolation`'s, shared with `rlblocks.rewards.ProcessPool`; what is this
module's is what a call asks and how its answer reads (`rlblocks.envs.tool_worker`).

**How a tool travels** (cloudpickle, `pickled_tool`): by value when it is code of yours (a
notebook's or a script's function, a closure, a function of a module outside the standard
library and the installed packages: a test file, a project checkout on ``sys.path``), so the
worker does not import that module and whatever it imports at its top (a test module or a
training script may import torch and transformers: 6 s in a fresh worker); by reference when
it comes from an installed package, or when by value fails (the function's module holds what
cannot be pickled): the worker then imports the module, once, with this process's
``sys.path``. `rlblocks.envs.calculator` imports only the standard library and always travels
by value.

The cost: one process; its start and each tool's first load (at most ``LOAD_LIMIT`` s, not
counted in the call's limit); per call, a round trip over a socket (~0.1 ms plus pickling the
arguments and the text).

**`ThreadRunner`.** A call runs in a daemon thread of this process and is waited for at most
its limit. A thread cannot be stopped: a call past its limit goes on until the function
returns, and a spinning one keeps a core busy for as long. So that such threads cannot pile
up, a tool whose earlier call still runs is answered with an error instead of a new thread:
at most one per tool. Use it for tools that must run in this process (they hold what cannot
be pickled) and whose time is bounded.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import signal
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import rlblocks.envs.calculator as calculator_module
import rlblocks.envs.tool_worker as handler  # the worker side of a call (rlblocks.isolation)
from rlblocks.envs.tool_worker import run, shown
from rlblocks.isolation.process import LOAD_LIMIT, WorkerProcess, kill_all
from rlblocks.isolation.worker import describe


class ToolRunner(Protocol):
    """Where `ToolEnv` runs its calls."""

    def prepare(self, fn: Callable[..., Any]) -> None:
        """Check, when the environment is built, that ``fn`` can run here; raise if not."""
        ...

    def call(
        self, fn: Callable[..., Any], arguments: Mapping[str, Any], *, timeout: float, limit: int
    ) -> tuple[str, bool]:
        """``(text, ok)`` of ``fn(**arguments)``, its text at most ``limit`` characters (plus
        the cut marker), within ``timeout`` seconds. Never raises for what the tool does."""
        ...

    def close(self) -> None:
        """Stop whatever the runner started."""
        ...


class ProcessRunner:
    """Runs each tool call in a worker process that a call past its time limit kills (module
    docstring). Pickles as a fresh runner (a `ToolEnv` sent to a Ray worker starts its own)."""

    def __init__(self) -> None:
        self._slot: list[_Worker] = []  # the live worker, if any; the finalizer empties it
        self._tools: dict[int, tuple[Callable[..., Any], bytes]] = {}  # id(fn) -> (fn, pickled)
        self._lock = threading.Lock()  # one call at a time
        self._finalizer = weakref.finalize(self, kill_all, self._slot)

    def prepare(self, fn: Callable[..., Any]) -> None:
        """Pickle ``fn`` now: a tool that cannot travel to the worker is refused when the
        environment is built, not at its first call."""
        self._pickled(fn)

    def call(
        self, fn: Callable[..., Any], arguments: Mapping[str, Any], *, timeout: float, limit: int
    ) -> tuple[str, bool]:
        """``(text, ok)`` of one call, run in the worker (`ToolRunner.call`)."""
        name = tool_name(fn)
        try:
            message = pickle.dumps(("call", id(fn), dict(arguments), limit))
        except Exception as error:  # noqa: BLE001 - arguments a custom parser made
            text = f"Error: the arguments cannot be sent to {name}: {describe(error)}"
            return shown(text, limit), False
        fn_bytes = self._pickled(fn)
        with self._lock:
            worker = self._worker()
            try:
                if id(fn) not in worker.loaded:
                    self._load(worker, name, id(fn), fn_bytes)
                reply = worker.ask(message, timeout)
            except BaseException:  # Ctrl-C mid-call: its late reply must not answer the next
                if worker in self._slot:
                    self._retire(worker)
                raise
            if reply is None:  # past its limit: the worker and all it started are killed
                self._retire(worker)
                return f"Error: {name} did not finish within {timeout:g} s; it was stopped", False
            if reply[0] == "failed":
                self._retire(worker)
                return f"Error: {name} {reply[1]}", False
            return reply[1], reply[2]

    @property
    def pid(self) -> int | None:
        """The worker's process id (also its process group's), None before the first call."""
        return self._slot[0].process.pid if self._slot else None

    def close(self) -> None:
        """Kill the worker with its process group; a later call starts a new one."""
        kill_all(self._slot)

    def __reduce__(self) -> tuple:
        return (ProcessRunner, ())

    def __repr__(self) -> str:
        return f"ProcessRunner(pid={self.pid})"

    def _pickled(self, fn: Callable[..., Any]) -> bytes:
        if id(fn) not in self._tools:
            self._tools[id(fn)] = (fn, pickled_tool(fn))
        return self._tools[id(fn)][1]

    def _worker(self) -> _Worker:
        if self._slot and self._slot[0].process.proc.poll() is not None:  # died while idle
            self._retire(self._slot[0])
        if not self._slot:
            self._slot.append(_Worker())
        return self._slot[0]

    def _load(self, worker: _Worker, name: str, key: int, fn_bytes: bytes) -> None:
        reply = worker.ask(("load", key, fn_bytes, list(sys.path)), LOAD_LIMIT)
        if reply is None or reply[0] != "loaded":
            self._retire(worker)
            why = f"took over {LOAD_LIMIT:g} s" if reply is None else reply[1]
            raise RuntimeError(
                f"ProcessRunner: the worker process cannot load the tool {name!r} ({why}); "
                "define it where a fresh Python can import it (the worker gets this process's "
                "sys.path), or pass runner=rb.envs.ThreadRunner() to run it in this process"
            )
        worker.loaded.add(key)

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        self._slot.remove(worker)


class _Worker:
    """One worker process (`rlblocks.isolation.WorkerProcess`) and the tools it has loaded."""

    def __init__(self) -> None:
        self.process = WorkerProcess(handler)
        self.loaded: set[int] = set()  # keys of the tools it has unpickled

    def ask(self, message: Any, timeout: float) -> tuple | None:
        """Send ``message`` (a tuple, or its pickle) and wait at most ``timeout`` s for the
        reply: the reply, ``("failed", what happened)`` if the worker ended or its reply is not
        the worker's JSON (it is then killed), None if time ran out."""
        deadline = time.monotonic() + timeout
        conn = self.process.conn
        try:
            self.process.send(message)
            if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                return None
            reply = conn.recv_bytes()
        except (EOFError, OSError):
            return ("failed", f"ended its worker process ({_death_note(self.kill())})")
        try:
            return tuple(json.loads(reply))
        except ValueError:  # the tool wrote on the socket itself
            self.kill()
            return ("failed", "wrote on its worker's socket; the worker was stopped")

    def kill(self) -> int:
        """Kill the worker with its process group (`WorkerProcess.kill`); its exit status."""
        return self.process.kill()


def pickled_tool(fn: Callable[..., Any]) -> bytes:
    """``fn`` pickled for the worker (module docstring): by value when it is code of yours, else
    (or when that fails) by reference. Raises ``ValueError`` naming the tool when neither
    works."""
    import cloudpickle  # here: only a process runner needs it

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is calculator_module or (module is not None and _own_code(module)):
        with _by_value(cloudpickle, module):
            try:
                return cloudpickle.dumps(fn)
            except Exception:  # noqa: BLE001, S110 - its module holds what cannot travel: by name
                pass
    try:
        return cloudpickle.dumps(fn)
    except Exception as error:
        raise ValueError(
            f"ProcessRunner: cannot pickle the tool {tool_name(fn)!r} for its worker process "
            f"({describe(error)}); define it at module level or in the notebook and make what "
            "it captures picklable, or pass runner=rb.envs.ThreadRunner() to run it in this "
            "process"
        ) from error


def _own_code(module: ModuleType) -> bool:
    """True for a module with a file outside the standard library and the installed packages."""
    file = getattr(module, "__file__", None)
    if not file or module.__name__ == "__main__":
        return False  # built in; __main__'s functions travel by value anyway
    installed = {
        sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")
    }
    path = Path(file).resolve()
    return not any(path.is_relative_to(Path(root).resolve()) for root in installed)


@contextlib.contextmanager
def _by_value(cloudpickle: ModuleType, module: ModuleType) -> Iterator[None]:
    """Let cloudpickle pickle ``module``'s functions and classes by value for a moment; a
    module registered before stays registered."""
    try:
        cloudpickle.unregister_pickle_by_value(module)
        registered = True
    except ValueError:  # it was not registered: the usual case
        registered = False
    cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        if not registered:
            cloudpickle.unregister_pickle_by_value(module)


def _death_note(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class ThreadRunner:
    """Runs each tool call in a daemon thread of this process (module docstring): a call past
    its limit cannot be stopped, and at most one such call per tool is left running."""

    def __init__(self) -> None:
        self._late: dict[int, tuple[Callable[..., Any], threading.Thread]] = {}

    def prepare(self, fn: Callable[..., Any]) -> None:
        """Nothing to check: the tool runs in this process."""

    def call(
        self, fn: Callable[..., Any], arguments: Mapping[str, Any], *, timeout: float, limit: int
    ) -> tuple[str, bool]:
        """``(text, ok)`` of one call, run in a thread (`ToolRunner.call`)."""
        name = tool_name(fn)
        late = self._late.get(id(fn))
        if late is not None and late[1].is_alive():
            text = f"Error: {name} is still running an earlier call that passed its time limit"
            return f"{text}; it was not called again", False
        box: dict[str, tuple[str, bool]] = {}
        worker = threading.Thread(
            target=lambda: box.update(answer=run(fn, arguments, limit)),
            daemon=True,
            name=f"tool-{name}",
        )
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            self._late[id(fn)] = (fn, worker)
            return f"Error: {name} did not finish within {timeout:g} s", False
        return box["answer"]

    def running(self) -> list[threading.Thread]:
        """The threads of calls that passed their limit and still run."""
        return [thread for _, thread in self._late.values() if thread.is_alive()]

    def close(self) -> None:
        """Nothing to stop (threads cannot be)."""

    def __reduce__(self) -> tuple:
        return (ThreadRunner, ())


def tool_name(fn: Callable[..., Any]) -> str:
    """A tool's name: its function's ``__name__`` (the name in its schema)."""
    return getattr(fn, "__name__", type(fn).__name__)


__all__ = ["LOAD_LIMIT", "ProcessRunner", "ThreadRunner", "ToolRunner", "pickled_tool"]
