"""`rlblocks.isolation`: a worker process runs without the rlblocks package, loads functions
with the caller's ``sys.path``, answers through its handler, and `WorkerProcess.kill` ends it.

The handler here is a module file written for the test, loaded by the worker the way
`rlblocks.envs.tool_worker` and `rlblocks.rewards.isolation_worker` are. Every wait is bounded
by a generous limit (a busy machine), never timed.
"""

from __future__ import annotations

import json
import operator
import pickle
import signal
import sys
import textwrap
from types import ModuleType

import pytest

from rlblocks.isolation import WorkerProcess, kill_all

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups")

WAIT = 60.0  # seconds: a bound on a fresh interpreter's start on a loaded machine, not a timing

HANDLER = textwrap.dedent("""
    import json, sys
    from rlblocks.isolation.worker import describe

    def handle(message, loaded):
        _, key, *args = message
        modules = sorted(name for name in sys.modules if name.partition(".")[0] == "rlblocks")
        return encode((modules, "torch" in sys.modules, loaded[key](*args)))

    def encode(reply):
        return json.dumps(reply).encode()
""")


@pytest.fixture
def handler(tmp_path) -> ModuleType:
    path = tmp_path / "probe_handler.py"
    path.write_text(HANDLER)
    module = ModuleType("probe_handler")  # the worker needs only its name and file
    module.__file__ = str(path)
    return module


def ask(worker: WorkerProcess, message: tuple) -> list:
    worker.send(message)
    assert worker.conn.poll(WAIT), "no reply from the worker"
    return json.loads(worker.conn.recv_bytes())


def test_a_worker_runs_without_the_package_and_answers_through_its_handler(handler):
    worker = WorkerProcess(handler)
    try:
        assert ask(worker, ("load", 7, pickle.dumps(operator.add), sys.path)) == ["loaded"]
        modules, torch_loaded, value = ask(worker, ("call", 7, 2, 3))
        assert value == 5
        # Only the worker's own module, loaded by name from its file: no rlblocks/__init__.py
        # ran, so neither did its torch import.
        assert (modules, torch_loaded) == (["rlblocks.isolation.worker"], False)
        kind, text = ask(worker, ("load", 8, b"not a pickle", sys.path))
        assert kind == "load_error" and text.startswith("UnpicklingError: ")
    finally:
        worker.kill()


def test_kill_ends_the_worker_once_and_kill_all_empties_the_list(handler):
    workers = [WorkerProcess(handler), WorkerProcess(handler)]
    first = workers[0]
    assert ask(first, ("load", 0, pickle.dumps(operator.neg), sys.path)) == ["loaded"]
    kill_all(workers)
    assert workers == []
    assert first.kill() == -signal.SIGKILL  # reaped once; a second kill keeps its status
    with pytest.raises(OSError):
        first.send(("call", 0, 1))  # its socket is closed
