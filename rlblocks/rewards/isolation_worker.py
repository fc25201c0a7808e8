"""The worker's side of `rlblocks.rewards.isolation.ProcessPool`: score one row.

In a worker process this module is the handler of `rlblocks.isolation.worker`, which loads it
from its file without importing the rlblocks package (it imports only the standard library and
that module), starts it in its own session and process group, loads the reward function under
the key ``FN`` and keeps the fork guard and the watchdog. Each reply is one pickled tuple::

    pool -> worker   ("load", FN, fn_bytes, sys_path)   worker -> pool   ("loaded",) | ("load_error", text)
    pool -> worker   ("row", i, completion, row)        worker -> pool   ("ok", i, value)
                                                                         | ("error", i, text, exc_bytes, traceback)

(the first answered by `rlblocks.isolation.worker` itself, the second by `handle`).
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from rlblocks.isolation.worker import describe

FN = 0  # the key the reward function is loaded under: a worker holds one at a time


def handle(message: tuple, loaded: dict[int, Any]) -> bytes:
    """The reply to a ``("row", i, completion, row)`` message: ``fn(completion, **row)``'s value
    or its error, pickled here so that an unpicklable result fails the row, not the worker."""
    _, i, completion, row = message
    try:
        value = loaded[FN](completion, **row)
        try:
            return pickle.dumps(("ok", i, value))
        except Exception:  # noqa: BLE001 -- any object fn returns; the pool reports the row
            return _error(i, f"returned {type(value).__name__}, which cannot be pickled", None)
    except BaseException as e:  # noqa: BLE001 -- SystemExit from fn included: the row fails
        return _error(i, describe(e), e)


def encode(reply: tuple) -> bytes:
    """A reply as the pool reads it: pickled."""
    return pickle.dumps(reply)


def _error(i: int, text: str, error: BaseException | None) -> bytes:
    """An error reply; the exception travels too when it pickles (for ``raise_errors``)."""
    tb = traceback.format_exc() if error is not None else ""
    try:
        exc_bytes = pickle.dumps(error) if error is not None else None
    except Exception:  # noqa: BLE001 -- an exception holding unpicklable state: text only
        exc_bytes = None
    return pickle.dumps(("error", i, text, exc_bytes, tb))
