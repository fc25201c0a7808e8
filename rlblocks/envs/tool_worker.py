"""One tool call as the model's text, never raising; and the worker process's side of a call.

`run` is what every runner does with a call (`rlblocks.envs.runners`): ``fn(**arguments)``,
then its value as text, then that text cut to a size, all inside the call's guard, so that
nothing a tool returns can raise in the agent loop:

- a string is the text as it is; anything else is JSON (``default=str``), or its ``repr`` when
  JSON cannot take it (tuple keys, a cycle), or an error saying it cannot be shown (an integer
  past Python's 4300 digits, a ``__repr__`` that raises);
- an exception is ``"Error: <type>: <message>"``, its message read under a guard too;
- the text is cut to ``limit`` characters with a marker saying how many were cut, and lone
  surrogates (which no tokenizer takes) become ``?``.

In a worker process this module is the handler of `rlblocks.isolation.worker`, which loads it
from its file without importing the rlblocks package (it imports only the standard library and
that module), for `rlblocks.envs.runners.ProcessRunner`. The tools arrive pickled by cloudpickle
and import what they need. Replies go back as JSON, so that nothing a tool writes on the socket
can run code in the runner's process::

    runner -> worker  ("load", key, fn_bytes, sys_path)   worker -> runner  ["loaded"] | ["load_error", text]
    runner -> worker  ("call", key, arguments, limit)     worker -> runner  ["done", text, ok]

(the first answered by `rlblocks.isolation.worker` itself, the second by `handle`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from rlblocks.isolation.worker import describe

MAX_RESULT_CHARS = 8_000
"""Characters of a tool message the model reads by default (``ToolEnv(max_result_chars=)``)."""


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


# ---------------------------------------------------------------------- in the worker process
def handle(message: tuple, tools: Mapping[int, Callable[..., Any]]) -> bytes:
    """The encoded reply to a ``("call", key, arguments, limit)`` message: `run` of the tool
    loaded under ``key``."""
    _, key, arguments, limit = message
    return encode(("done", *run(tools[key], arguments, limit)))


def encode(reply: tuple) -> bytes:
    """A reply as the runner reads it: JSON, which cannot run code when it is read."""
    return json.dumps(reply).encode()
