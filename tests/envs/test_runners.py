"""Where tool calls run: a call past its limit leaves nothing running (`ProcessRunner`, the
default), and what exactly a `ThreadRunner` leaves behind.

Real processes throughout. The test process is made a child subreaper, so a program a tool
started, whose worker was killed, is re-parented to it instead of disappearing from view; each
process test ends by checking that no process and no thread it started is still alive.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
from agent_cases import ScriptedEngine
from proc_helpers import live_descendants, processes

from rlblocks.envs import (
    AgentEngine,
    ModelTurn,
    ProcessRunner,
    ThreadRunner,
    ToolEnv,
    calculator,
    parse_tool_calls,
    tool_worker,
)
from rlblocks.isolation.process import worker_command

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

PR_SET_CHILD_SUBREAPER = 36


def alive(pid: int) -> bool:
    return processes().get(pid, (0, "X"))[1] not in "ZX"


@pytest.fixture
def no_leftovers():
    """Fail the test if a process or thread it started is still alive 2 s after it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    me, threads_before = os.getpid(), set(threading.enumerate())
    before = live_descendants(me)
    yield
    deadline = time.monotonic() + 2.0
    while (left := live_descendants(me) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid, (ppid, state) in processes().items():  # orphans re-parented to us: reap them
        if ppid == me and state == "Z":
            os.waitpid(pid, os.WNOHANG)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    assert not left, f"processes outlived the test: {sorted(left)}"
    assert set(threading.enumerate()) <= threads_before, "threads outlived the test"


def spin(pid_file: str) -> str:
    """Start a program, then never return.

    Args:
        pid_file: Where to write the program's process id.
    """
    child = subprocess.Popen(["sleep", "60"])
    Path(pid_file).write_text(str(child.pid))
    while True:
        pass


def turn(text: str) -> ModelTurn:
    return ModelTurn(text, tuple(parse_tool_calls(text)), 0)


def test_a_spinning_tool_and_what_it_started_end_with_its_time_limit(no_leftovers, tmp_path):
    # Before: the call ran in a thread, which spun on for the life of the process, and its
    # `sleep 60` lived its minute.
    pid_file = tmp_path / "sleep.pid"
    me = os.getpid()
    before = live_descendants(me)
    threads = set(threading.enumerate())
    arguments = json.dumps({"pid_file": str(pid_file)})
    script = [f'<tool_call>{{"name": "spin", "arguments": {arguments}}}</tool_call>', "No luck."]
    env = ToolEnv([spin], timeout=0.5)
    agent = AgentEngine(ScriptedEngine(script), env, max_turns=2)
    ro = agent.generate(["Spin."])
    info = ro.metadata[0]["agent"]
    tool = next(m["content"] for m in info["messages"] if m["role"] == "tool")
    assert tool == "Error: spin did not finish within 0.5 s; it was stopped"
    assert info["tool_errors"] == 1 and info["end"] == "done"  # the episode went on
    # By the time the answer came back the worker was dead and reaped (SIGKILL to its process
    # group, then wait); its `sleep` got the same SIGKILL, which the kernel delivers within
    # milliseconds: 1 s is the bound, not a measured time.
    sleep = int(pid_file.read_text())
    deadline = time.monotonic() + 1.0
    while (left := live_descendants(me) - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert left == set() and not alive(sleep)
    assert set(threading.enumerate()) <= threads
    assert env.runner.pid is None  # the next call starts a fresh worker
    env.close()


def daemonize(pid_file: str) -> str:
    """Start a program in a session of its own (setsid) and return at once.

    Args:
        pid_file: Where to write the program's process id.
    """
    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    Path(pid_file).write_text(str(child.pid))
    return "started"


def test_a_program_a_tool_started_in_its_own_session_ends_with_close(tmp_path):
    # It left the worker's process group, which SIGKILL for the group did not reach: the
    # `sleep 300` outlived ToolEnv.close(). (No subreaper in this test process: on the old
    # code the orphan went to init and lived on, out of this process's sight.)
    pid_file = tmp_path / "sleep.pid"
    env = ToolEnv([daemonize])
    arguments = json.dumps({"pid_file": str(pid_file)})
    text = f'<tool_call>{{"name": "daemonize", "arguments": {arguments}}}</tool_call>'
    try:
        step = env.step(turn(text), {})
        assert [m["content"] for m in step.messages] == ["started"]
        sleep = int(pid_file.read_text())
        assert alive(sleep)
    finally:
        env.close()
    deadline = time.monotonic() + 2.0  # SIGKILL is delivered within milliseconds; the bound
    while alive(sleep) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(sleep)


def crash() -> str:
    """End the process at once."""
    os.kill(os.getpid(), signal.SIGSEGV)
    return "unreachable"


def test_a_tool_that_kills_its_process_fails_its_call_and_the_next_call_runs(no_leftovers):
    with ToolEnv([crash, calculator]) as env:
        text = (
            '<tool_call>{"name": "crash", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
        )
        step = env.step(turn(text), {})
        assert [m["content"] for m in step.messages] == [
            "Error: crash ended its worker process (killed by SIGSEGV)",
            "42",
        ]
        assert step.info["tool_errors"] == 1
        first_worker = env.runner.pid
        assert first_worker is not None and alive(first_worker)  # the calculator's worker
    assert not alive(first_worker)  # close() killed it


def test_a_tool_that_cannot_travel_is_refused_when_the_env_is_built():
    lock = threading.Lock()  # cannot be pickled
    seen = []

    def guarded(word: str) -> str:
        """Record a word.

        Args:
            word: The word.
        """
        with lock:
            seen.append(word)
        return word.upper()

    with pytest.raises(ValueError, match="cannot pickle the tool 'guarded'.*ThreadRunner"):
        ToolEnv([guarded])
    # In this process it runs, and its effects are visible here.
    env = ToolEnv([guarded], runner=ThreadRunner())
    step = env.step(
        turn('<tool_call>{"name": "guarded", "arguments": {"word": "hi"}}</tool_call>'), {}
    )
    assert [m["content"] for m in step.messages] == ["HI"] and seen == ["hi"]


def forge(path: str) -> str:
    """Write a reply of its own on the worker's socket: a pickle that would run a command.

    Args:
        path: The file the command would create.
    """

    class Command:
        def __reduce__(self):
            return (os.system, (f"touch {path}",))

    data = pickle.dumps(("done", Command(), True))
    os.write(int(sys.argv[-1]), len(data).to_bytes(4, "big") + data)  # Connection's framing
    return "innocent"


def test_what_a_tool_writes_on_the_socket_is_never_unpickled(tmp_path, no_leftovers):
    # Replies come back as JSON: a forged pickle is a failed call, not a command run here.
    with ToolEnv([forge]) as env:
        text = json.dumps({"name": "forge", "arguments": {"path": str(tmp_path / "pwned")}})
        step = env.step(turn(f"<tool_call>{text}</tool_call>"), {})
    assert [m["content"] for m in step.messages] == [
        "Error: forge wrote on its worker's socket; the worker was stopped"
    ]
    assert not (tmp_path / "pwned").exists()


def test_module_tools_travel_by_value_and_fall_back_to_their_module(tmp_path, no_leftovers):
    # A tool of a module of yours travels by value: the worker never imports the module (here
    # it could not: the module's folder leaves sys.path). One whose module holds what cannot be
    # pickled (a lock) travels by name, and the worker cannot import it: that call raises,
    # naming the tool (every call would fail the same way; a setup error, not the model's).
    (tmp_path / "user_tools.py").write_text(
        "import threading\n"
        "LOCK = threading.Lock()\n\n"
        'def shout(word: str) -> str:\n    """Shout.\n\n    Args:\n        word: A word.\n    """\n'
        "    return word.upper()\n\n"
        'def locked(word: str) -> str:\n    """Shout, holding the lock.\n\n    Args:\n'
        '        word: A word.\n    """\n'
        "    with LOCK:\n        return word.upper()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        from user_tools import locked, shout
    finally:
        sys.path.remove(str(tmp_path))
    with ToolEnv([shout, locked]) as env:
        text = '<tool_call>{"name": "shout", "arguments": {"word": "a"}}</tool_call>'
        assert [m["content"] for m in env.step(turn(text), {}).messages] == ["A"]
        text = '<tool_call>{"name": "locked", "arguments": {"word": "a"}}</tool_call>'
        with pytest.raises(RuntimeError, match="cannot load the tool 'locked'.*user_tools"):
            env.step(turn(text), {})
    sys.modules.pop("user_tools")


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def test_a_thread_runner_leaves_a_late_call_running_until_it_returns_and_only_one():
    runner = ThreadRunner()
    start = time.monotonic()
    assert runner.call(nap, {"seconds": 1.0}, timeout=0.2, limit=100) == (
        "Error: nap did not finish within 0.2 s",
        False,
    )
    assert time.monotonic() - start < 1.0  # the caller waited 0.2 s, not 1 s
    (late,) = runner.running()  # the call goes on in its thread: nothing can stop it
    assert late.is_alive() and late.daemon and late.name == "tool-nap"
    # While it runs, the tool is not called again: no second thread.
    refused = "Error: nap is still running an earlier call that passed its time limit"
    assert runner.call(nap, {"seconds": 0.0}, timeout=0.2, limit=100) == (
        f"{refused}; it was not called again",
        False,
    )
    assert runner.running() == [late]
    late.join(timeout=5.0)  # it ends when the function returns (1 s after it started)
    assert not late.is_alive() and runner.running() == []
    assert runner.call(nap, {"seconds": 0.0}, timeout=1.0, limit=100) == ("awake", True)


def test_an_interrupted_call_does_not_answer_the_next_one(no_leftovers):
    # Ctrl-C in a notebook while a tool runs: the worker, still busy with the interrupted
    # call, is stopped; otherwise its late "awake" would be read as the next call's answer.
    # A shell starts a background job with SIGINT ignored, and Python then keeps it ignored:
    # the test installs Python's own Ctrl-C handler for its duration (what a kernel has).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with ToolEnv([nap, calculator]) as env:

            def interrupt_mid_nap() -> None:
                # Once the worker has loaded the tool (a loaded machine may take seconds to
                # start it), the nap is under way: interrupt it then, not at a fixed time.
                deadline = time.monotonic() + 30.0
                while not (env.runner._slot and env.runner._slot[0].loaded):
                    assert time.monotonic() < deadline, "the worker never loaded the tool"
                    time.sleep(0.01)
                time.sleep(0.3)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

            interrupt = threading.Thread(target=interrupt_mid_nap)
            interrupt.start()
            with pytest.raises(KeyboardInterrupt):
                env.runner.call(nap, {"seconds": 3.0}, timeout=10.0, limit=100)
            interrupt.join()
            assert env.runner.pid is None
            time.sleep(3.0)  # past the end of the interrupted nap
            answer = env.runner.call(calculator, {"expression": "1 + 1"}, timeout=10.0, limit=100)
            assert answer == ("2", True)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_worker_kills_itself_and_its_programs_when_its_runner_dies(tmp_path, no_leftovers):
    # A stand-in for a training process killed outright: it starts the worker exactly as
    # ProcessRunner does, makes a call that runs `sleep 60`, and is SIGKILLed mid-call.
    runner = tmp_path / "runner.py"
    runner.write_text(
        "import json, pickle, subprocess, sys, time\n"
        "from multiprocessing.connection import Connection\n"
        "from socket import socketpair\n"
        "ours, theirs = socketpair()\n"
        "worker = subprocess.Popen([*sys.argv[1:], str(theirs.fileno())],\n"
        "    pass_fds=(theirs.fileno(),), start_new_session=True)\n"
        "conn = Connection(ours.detach())\n"
        "conn.send_bytes(pickle.dumps(('load', 0, pickle.dumps(subprocess.run), sys.path)))\n"
        "assert json.loads(conn.recv_bytes()) == ['loaded']\n"
        "conn.send_bytes(pickle.dumps(('call', 0, {'args': ['sleep', '60']}, 100)))\n"
        "print(worker.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(runner), *worker_command(tool_worker)], stdout=subprocess.PIPE
    )
    worker = int(proc.stdout.readline())
    deadline = time.monotonic() + 5.0
    while not (sleeps := [p for p, (pp, _) in processes().items() if pp == worker]):
        assert time.monotonic() < deadline, "the tool's sleep never started"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    deadline = time.monotonic() + 3.0  # the worker checks its parent every 0.5 s
    while any(alive(p) for p in (worker, *sleeps)):
        assert time.monotonic() < deadline, "the worker outlived its runner"
        time.sleep(0.02)


def test_a_process_runner_pickles_as_a_fresh_one():
    runner = ProcessRunner()
    assert runner.call(calculator, {"expression": "2 ** 10"}, timeout=5.0, limit=100) == (
        "1024",
        True,
    )
    copy = pickle.loads(cloudpickle.dumps(runner))  # a ToolEnv sent to a Ray worker
    assert copy.pid is None and runner.pid is not None
    runner.close()
    assert runner.pid is None
