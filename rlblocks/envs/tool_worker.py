"""One tool call as the model's text, never raising; and the worker process that runs calls.

`run` is what every runner does with a call (`rlblocks.envs.runners`): ``fn(**arguments)``,
then its value as text, then that text cut to a size, all inside the call's guard, so that
nothing a tool returns can raise in the agent loop:

- a string is the text as it is; anything else is JSON (``default=str``), or its ``repr`` when
  JSON cannot take it (tuple keys, a cycle), or an error saying it cannot be shown (an integer
  past Python's 4300 digits, a ``__repr__`` that raises);
- an exception is ``"Error: <type>: <message>"``, its message read under a guard too;
- the text is cut to ``limit`` characters with a marker saying how many were cut, and lone
  surrogates (which no tokenizer takes) become ``?``.

Run as a script (``python -c`` through `runpy.run_path`, in its own session and process group,
by `rlblocks.envs.runners.ProcessRunner`) this file is the worker: it imports only the standard
library, so nothing of the caller's process (torch thread pools, Ray connections, CUDA state)
is copied into it; the tools arrive pickled by cloudpickle and import what they need. Messages
(`multiprocessing.connection.Connection` framing) go to the worker pickled and come back as
JSON, so that nothing a tool writes on the socket can run code in the runner's process::

    runner -> worker  ("load", key, fn_bytes, sys_path)   worker -> runner  ["loaded"] | ["load_error", text]
    runner -> worker  ("call", key, arguments, limit)     worker -> runner  ["done", text, ok]

Two guards live in the worker: a child that a tool forked and that returns from the tool exits
at once (it never answers), and the worker kills its own process group once the runner's
process is gone (even by SIGKILL).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

MAX_RESULT_CHARS = 8_000
"""Characters of a tool message the model reads by default (``ToolEnv(max_result_chars=)``)."""
WATCH_INTERVAL = 0.5  # seconds between two checks that the runner's process is still alive


def run(fn: Callable[..., Any], arguments: Mapping[str, Any], limit: int) -> tuple[str, bool]:
    """``(text, ok)`` of ``fn(**arguments)``: the tool message's content (module docstring) and
    whether the call succeeded. Never raises."""
    try:
        value = fn(**arguments)
    except BaseException as error:  # noqa: BLE001 - SystemExit too: the model reads what happened
        return shown(f"Error: {describe(error)}", limit), False
    text, ok = result_text(value)
    return shown(text, limit), ok


def result_text(value: Any) -> tuple[str, bool]:
    """A tool's return value as text: the string itself, JSON, or its ``repr``; ``ok`` False
    (and the text an error) when none of them can be had."""
    if isinstance(value, str):
        return value, True
    for render in (lambda: json.dumps(value, default=str), lambda: repr(value)):
        try:  # JSON fails on tuple keys, a cycle, a huge int, a str() that raises
            return render(), True
        except Exception as error:  # noqa: BLE001 - a __repr__ that raises too: said below
            failure = error
    what = f"Error: the tool's result (a {type(value).__name__}) cannot be shown as text"
    return f"{what}: {describe(failure)}", False


def describe(error: BaseException) -> str:
    """``"<type>: <message>"`` of an exception whose ``__str__`` may itself raise."""
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - an exception class with a broken __str__
        message = "(its message cannot be shown)"
    return f"{type(error).__name__}: {message}"


def shown(text: str, limit: int) -> str:
    """``text`` as the model reads it: at most ``limit`` characters of it, then a marker that
    says how many were cut; lone surrogates (invalid in UTF-8) replaced by ``?``."""
    if len(text) > limit:
        text = (
            f"{text[:limit]}\n[... {len(text) - limit} more characters cut: the result has "
            f"{len(text)}, the limit is {limit}]"
        )
    return valid_utf8(text)


def valid_utf8(text: str) -> str:
    """``text`` with lone surrogates (which UTF-8 cannot encode, nor a tokenizer take) as ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


# ---------------------------------------------------------------------- the worker process
def main(fd: int) -> None:
    """Serve calls until the runner closes its end of the socket."""
    os.set_inheritable(fd, False)  # programs that a tool starts must not hold the socket
    conn = Connection(fd)
    me, parent = os.getpid(), os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    tools: dict[int, Callable[..., Any]] = {}
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the runner closed the socket or its process is gone
        if message[0] == "load":
            reply = _load(tools, *message[1:])
        else:
            _, key, arguments, limit = message
            try:
                reply = ("done", *run(tools[key], arguments, limit))
            finally:
                if os.getpid() != me:  # a child forked inside the tool came back: it must exit
                    os._exit(0)
        conn.send_bytes(json.dumps(reply).encode())
        _reap_children()


def _load(tools: dict, key: int, fn_bytes: bytes, sys_path: list[str]) -> tuple:
    """Unpickle a tool with the runner's ``sys.path`` (so by-reference imports work)."""
    sys.path[:] = sys_path
    try:
        tools[key] = pickle.loads(fn_bytes)
    except BaseException as error:  # noqa: BLE001 - reported to the runner, which raises it
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
    """Kill this worker's process group once the runner's process is gone (re-parented)."""
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL)
    os.killpg(os.getpgid(0), signal.SIGKILL)


if __name__ == "__main__":
    main(int(sys.argv[1]))
