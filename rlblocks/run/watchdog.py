"""The stall watchdog: every phase of a step has a deadline; past it, say where the run is stuck.

A run that stops moving without an error is the field's most reported failure: a reward call
that never returns, a rank that never joins a collective, an engine that blocks. The
watchdog turns that silence into a report::

    run = rb.run.RunOptions(watchdog=rb.run.Watchdog(on_stall="interrupt"))

**Deadlines.** A phase (``rollout``, ``reward``, ``logprobs``, ``update``, ``sync``,
``checkpoint``) gets the deadline the user set for it (``deadlines={"reward": 120}``), else one
derived from the run's own earlier steps: ``factor`` × the longest that phase has taken so far,
and at least ``floor`` seconds. Before a phase has been seen once it has ``first`` seconds
(the first step also loads and compiles). A deadline of 0 or less is refused.

**The report**, written once per stalled phase to ``stream`` (stderr) and, with ``folder``,
to ``stall-step<step>-<phase>.txt`` there, names:

- the step and the phase, how long it has run and the deadline it passed (and where that
  deadline came from);
- the rows in flight, as the step noted them (``Clock.note``: the rollout source notes the
  prompts it is sampling);
- the Python stack of every thread of this process, the stuck one first;
- the stacks of every worker the watchdog was given (``workers``: objects with a
  ``stacks() -> str`` method), each under its name; a worker that does not answer within
  ``worker_timeout`` seconds is named as not answering. `SignalStacks` is one for a process
  on this machine that called `serve_stacks` (a gloo rank, a spawned worker): it signals the
  process, whose ``faulthandler`` writes every thread's stack even while a thread is blocked
  in C code.

**Then** it waits (``on_stall="wait"``: the phase may still finish; the report is repeated at
2, 4, 8, ... times the deadline), interrupts the main thread (``"interrupt"``:
``KeyboardInterrupt`` where the main thread next runs Python, which a notebook cell shows as an
interrupted cell; a thread blocked inside C code, a collective say, is not woken by it), or
ends the process (``"exit"``: status ``STALL_EXIT`` after the report is flushed; the run's
checkpoints are whatever was saved before).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

from rlblocks.base.stacks import SignalStacks, serve_stacks, thread_stacks

STALL_EXIT = 75
"""The exit status of a process the watchdog ended (``on_stall="exit"``)."""

MIN_POLL = 0.01
"""The shortest ``Watchdog`` poll, in seconds: the watcher wakes at most 100 times a second."""

PHASES = ("rollout", "reward", "logprobs", "update", "sync", "checkpoint")
OnStall = Literal["wait", "interrupt", "exit"]


class Worker(Protocol):
    """Something whose stacks the report includes (a Ray worker handle, a process)."""

    def stacks(self) -> str:
        """Every thread's Python stack, as text."""


class Watchdog:
    """Deadlines per phase, a monitor thread, a report on a stall (module docstring)."""

    def __init__(
        self,
        deadlines: Mapping[str, float] | None = None,
        *,
        factor: float = 5.0,
        floor: float = 60.0,
        first: float = 1800.0,
        on_stall: OnStall = "wait",
        folder: str | Path | None = None,
        stream: TextIO | None = None,
        workers: Mapping[str, Worker] | None = None,
        worker_timeout: float = 10.0,
        poll: float = 0.25,
    ) -> None:
        deadlines = dict(deadlines or {})
        unknown = sorted(set(deadlines) - set(PHASES))
        if unknown:
            raise ValueError(f"Watchdog: no phase {unknown}; the phases are {PHASES}")
        for name, value in {**deadlines, "floor": floor, "first": first,
                            "factor": factor, "poll": poll}.items():  # fmt: skip
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(
                    f"Watchdog: {name}={value!r}; a deadline (and factor, floor, first, poll) "
                    "must be a number of seconds > 0"
                )
        if not MIN_POLL <= poll < math.inf:
            raise ValueError(
                f"Watchdog: poll={poll!r}; the watcher wakes every poll seconds: pass a finite "
                f"number >= {MIN_POLL} (a shorter one keeps a core busy checking the clock)"
            )
        if on_stall not in ("wait", "interrupt", "exit"):
            raise ValueError(f"Watchdog: on_stall={on_stall!r}; use 'wait', 'interrupt' or 'exit'")
        self.deadlines, self.factor, self.floor, self.first = deadlines, factor, floor, first
        self.on_stall, self.poll = on_stall, poll
        self.folder = None if folder is None else Path(folder)
        self.stream = stream
        self.workers = dict(workers or {})
        self.worker_timeout = worker_timeout
        self.longest: dict[str, float] = {}
        self.reports: list[str] = []
        """Every report written, in order (a notebook reads the last one here)."""
        self.stalls: list[tuple[float, str, int]] = []
        """(``time.monotonic()`` when reported, phase, step) of every report."""
        self._lock = threading.Lock()
        self._open: tuple[str, int, float, int] | None = None  # phase, step, since, thread
        self._notes: dict[str, Any] = {}
        self._reported = 0  # multiples of the deadline already reported for the open phase
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the run's side
    def deadline(self, phase: str) -> tuple[float, str]:
        """``phase``'s deadline in seconds, and where it comes from."""
        if phase in self.deadlines:
            return float(self.deadlines[phase]), "set by you"
        if phase in self.longest:
            derived = self.factor * self.longest[phase]
            if derived >= self.floor:
                return derived, f"{self.factor:g} × its longest so far, {self.longest[phase]:.1f} s"
            return self.floor, f"the floor ({self.factor:g} × {self.longest[phase]:.1f} s is less)"
        return self.first, "the first time this phase runs"

    def enter(self, phase: str, step: int) -> None:
        """``phase`` of ``step`` starts (in the calling thread)."""
        self._start()
        with self._lock:
            self._open = (phase, step, time.monotonic(), threading.get_ident())
            self._reported = 0

    def leave(self, phase: str, seconds: float) -> None:
        """The open phase ended after ``seconds``."""
        with self._lock:
            self.longest[phase] = max(self.longest.get(phase, 0.0), seconds)
            self._open = None

    def note(self, **info: Any) -> None:
        """What the step is working on (``rows=``, ``prompts=``), shown in a report."""
        with self._lock:
            self._notes.update(info)

    def clear_notes(self) -> None:
        """Forget the notes of the step before (the loop calls it as each step starts)."""
        with self._lock:
            self._notes = {}

    def close(self) -> None:
        """Stop the monitor thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # ------------------------------------------------------------------ the monitor
    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="rlblocks-watchdog",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            with self._lock:
                if self._open is None:
                    continue
                phase, step, since, ident = self._open
                elapsed = time.monotonic() - since
                limit, why = self.deadline(phase)
                if elapsed < limit * 2**self._reported:  # reported at 1, 2, 4, 8... × limit
                    continue
                self._reported += 1
                notes = dict(self._notes)
            self._report(phase, step, elapsed, limit, why, notes, ident)
            self._act()
            if self.on_stall != "wait":
                return

    def _report(
        self,
        phase: str,
        step: int,
        elapsed: float,
        limit: float,
        why: str,
        notes: dict[str, Any],
        ident: int,
    ) -> str:
        head = (
            f"rlblocks watchdog: step {step} is stuck in phase {phase!r}: it has run "
            f"{elapsed:.1f} s, past its deadline of {limit:.1f} s ({why}), on "
            f"{socket.gethostname()} pid {os.getpid()}"
        )
        lines = [head]
        if notes:
            lines.append("in flight: " + "; ".join(f"{k}: {_short(v)}" for k, v in notes.items()))
        then: str = self.on_stall
        if then == "interrupt" and signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
            then += " (SIGINT is ignored in this process: the interrupt will not be seen)"
        lines.append(f"then: {then}")
        lines.append(f"\n--- this process (pid {os.getpid()}), the stuck thread first ---")
        lines.append(thread_stacks(first=ident))
        for name, worker in self.workers.items():
            lines.append(f"\n--- worker {name} ---")
            lines.append(_ask(worker, self.worker_timeout))
        report = "\n".join(lines)
        self.reports.append(report)
        self.stalls.append((time.monotonic(), phase, step))
        stream = self.stream if self.stream is not None else sys.stderr
        print(report, file=stream, flush=True)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / f"stall-step{step}-{phase}.txt").write_text(report + "\n")
        return report

    def _act(self) -> None:
        if self.on_stall == "interrupt":
            # A real SIGINT to the main thread wakes a blocking call (a sleep, a lock's wait)
            # with EINTR so that the handler runs; _thread.interrupt_main alone only sets the
            # flag, which a blocked thread never reads. Where SIGINT has no Python handler (a
            # job started with SIGINT ignored), the flag is all there is.
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                main = threading.main_thread().ident
                assert main is not None  # the main thread has started
                signal.pthread_kill(main, signal.SIGINT)
            else:
                import _thread

                _thread.interrupt_main()
        elif self.on_stall == "exit":
            for stream in (sys.stdout, sys.stderr, self.stream):
                if stream is not None:
                    stream.flush()
            os._exit(STALL_EXIT)


def _ask(worker: Worker, timeout: float) -> str:
    """``worker.stacks()`` within ``timeout`` seconds, else a line saying it did not answer."""
    result: list[str] = []

    def call() -> None:
        try:
            result.append(worker.stacks())
        except Exception as error:  # noqa: BLE001 - the report names it
            result.append(f"(could not get its stacks: {type(error).__name__}: {error})")

    thread = threading.Thread(target=call, daemon=True, name="rlblocks-watchdog-ask")
    thread.start()
    thread.join(timeout)
    return result[0] if result else f"(did not answer within {timeout:g} s)"


def _short(value: Any) -> str:
    if isinstance(value, str):
        return value if len(value) < 200 else value[:197] + "..."
    if isinstance(value, Iterable) and not isinstance(value, bytes | dict):
        items = list(value)
        shown = ", ".join(_short(x) for x in items[:3])
        return f"{len(items)} [{shown}{', ...' if len(items) > 3 else ''}]"
    return repr(value)


__all__ = [
    "PHASES",
    "STALL_EXIT",
    "SignalStacks",
    "Watchdog",
    "Worker",
    "serve_stacks",
    "thread_stacks",
]
