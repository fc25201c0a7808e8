"""`per_sample`: turn a plain ``fn(completion, **row) -> float`` into a guarded batch reward.

A reward function written for one sample is the easiest thing to get right and to test, and the
most common thing to go wrong at scale: one odd completion in ten thousand makes a parser raise,
loop or return NaN. `per_sample` scores each row separately and gives the ``fallback`` score to
a row whose function raised, returned something that is not a finite real number, or ran past
``timeout`` seconds. Failures are counted in the metrics and reported by one logging warning per
batch; nothing is retried.

Time limits: threads or processes
---------------------------------
Where a row runs decides what a time limit can do to it. Three modes, chosen by the arguments:

- ``timeout=None``: rows run one by one in the calling thread, no limit. The easiest mode to
  debug (breakpoints, plain tracebacks).
- ``timeout=5.0`` (the default): rows run on daemon worker threads, each with a deadline counted
  from the moment a worker starts it. Python cannot stop a thread: when the deadline passes,
  the row gets the fallback score and its thread is **abandoned** (it keeps running until
  ``fn`` returns, holding whatever it holds, its late result thrown away) while a fresh worker
  takes the remaining rows. Costs nothing to start and microseconds per row: the right mode
  for cheap pure-Python rewards (regular expressions, answer parsing) that only rarely hang.
- ``pool=ProcessPool(workers=n)``: rows run in worker processes (`rlblocks.rewards.isolation`),
  each worker in its own process group. A row past its deadline is really stopped: the group
  gets SIGKILL, so a CPU-bound loop stops spinning and programs the row started die too, and a
  fresh worker replaces it; a worker that crashes fails only its row. The price: about 0.1 s
  to start a worker (once, workers live across calls), ~0.1 ms per row for the pipe, ``fn``
  must pickle with cloudpickle (notebook functions and closures do, by value), and it cannot
  change the caller's state. Use it for rewards that may spin in C or Python, run programs
  (the base of a sandboxed code reward), or call into native code that may crash.

Thread mode's limits, which users must know: a time limit only works while ``fn`` runs Python
bytecode or waits on I/O (a C call that holds the GIL, like a catastrophically backtracking
``re`` pattern, blocks the whole process until it returns); an abandoned thread still uses CPU
and memory, and children it started keep running; one that spins slows everything after it,
for good. So the first time a reward abandons a thread it says so (one logging warning per
reward function, naming the fix: a ``pool``), and from then on ``{key}/abandoned_threads``
counts its abandoned threads still running at the end of each call (0.0 once they have all
returned; absent while none was ever abandoned): a curve that only climbs is a reward that
spins.

In every mode, a child process that ``fn`` forks with ``os.fork()`` and that returns out of
``fn`` exits at once (``os._exit``): it never runs the caller's code, so a reward cannot leave
a second copy of the training loop running.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from rlblocks.interfaces import RewardFn, RewardOutput
from rlblocks.rewards.outcome import Failure, Outcome, checked_score, note_failure

if TYPE_CHECKING:
    from rlblocks.rewards.isolation import ProcessPool
    from rlblocks.rollouts import Rollouts

logger = logging.getLogger(__name__)

SampleFn = Callable[..., float]
"""A per-sample reward: ``fn(completion: str, **row) -> float``, row = metadata + ``prompt``."""


class RewardRowError(RuntimeError):
    """Raised by a `per_sample` reward built with ``raise_errors=True``; names the failing row."""


def per_sample(
    fn: SampleFn,
    *,
    timeout: float | None = 5.0,
    fallback: float = 0.0,
    raise_errors: bool = False,
    key: str = "reward",
    name: str | None = None,
    max_workers: int = 1,
    pool: ProcessPool | None = None,
) -> RewardFn:
    """Batch reward from a per-sample ``fn(completion, **row) -> float``, with guards.

    For row ``i`` the score is

        rᵢ = fn(completions[i], **metadata[i], prompt=prompts[i])   if it returns a finite real
        rᵢ = fallback                                               if it raises, returns NaN/±inf
                                                                    or a non-number, or times out

    Returns a `RewardFn`: ``rollouts -> RewardOutput(rewards (b) float32, metrics)``; the
    rewards carry no gradient. Metrics: ``{key}/mean`` (mean score, fallbacks included),
    ``{key}/failures`` (rows that got the fallback, timeouts included), ``{key}/timeouts`` and
    ``{key}/abandoned_threads`` (thread mode's timed-out rows still running, from the first
    one on: module docstring).

    ``timeout``: seconds per row, counted from the moment a worker starts it (see the module
    docstring for what happens to a hung row); ``None`` runs rows in the calling thread with no
    limit (or, with a ``pool``, in the pool with no limit). ``pool``: a
    `rlblocks.rewards.ProcessPool` to run the rows in worker processes that a timeout really
    kills (the caller owns it: close it, or use ``with``); rows that crash their worker fail.
    ``max_workers``: threads scoring rows at once when ``timeout`` is set; keep 1 for
    CPU-bound functions (the GIL serializes them anyway, and sharing it stretches each row's
    wall time towards its deadline), raise it for functions that wait on I/O. ``raise_errors``:
    raise `RewardRowError` for the first failing row instead of using the fallback (debugging).
    ``name``: the returned function's ``__name__`` (used by `combine`), default ``fn``'s name.

    Not from a paper: the guard that verl's reward managers and TRL's reward functions leave to
    the user.
    """
    if not math.isfinite(fallback):
        raise ValueError(
            f"per_sample: fallback must be finite, got {fallback}; pass a finite score"
        )
    if timeout is not None and timeout <= 0:
        raise ValueError(
            f"per_sample: timeout must be > 0 or None, got {timeout}; pass seconds, or None for "
            "no limit"
        )
    if max_workers < 1:
        raise ValueError(
            f"per_sample: max_workers must be >= 1, got {max_workers}; pass a positive count"
        )
    if pool is not None and max_workers != 1:
        raise ValueError(
            f"per_sample: max_workers={max_workers} with a pool, but max_workers counts threads "
            "and a pool has its own workers; leave max_workers at 1 (size the pool instead)"
        )
    label = name or _name_of(fn)
    abandoned = Abandoned(label, key, fix=POOL_FIX)

    def reward(rollouts: Rollouts, /) -> RewardOutput:
        completions = rollouts.completions
        rows = [{**meta, "prompt": p} for meta, p in zip(rollouts.metadata, rollouts.prompts)]
        score = partial(_score_row, fn, completions, rows)
        if pool is not None:
            outcomes = pool.map(fn, completions, rows, timeout=timeout)
        elif timeout is None:
            outcomes = [score(i) for i in range(len(rows))]
        else:
            outcomes = _run_with_deadlines(
                score, len(rows), timeout=timeout, max_workers=max_workers, abandoned=abandoned
            )
        out = _summarize(
            outcomes, fallback=fallback, key=key, label=label, raise_errors=raise_errors
        )
        abandoned.report(out.metrics)
        return out

    reward.__name__ = reward.__qualname__ = label
    reward.__doc__ = f"Guarded batch reward (`per_sample`) around {label}."
    return reward


def _name_of(fn: Callable[..., Any]) -> str:
    """``fn.__name__``, looking through `functools.partial`; the class name otherwise."""
    while isinstance(fn, partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _score_row(fn: SampleFn, completions: list[str], rows: list[dict], i: int) -> Outcome:
    """One row's score, or a `Failure` when ``fn`` raised or returned a non-finite non-number."""
    me = os.getpid()
    try:
        value = fn(completions[i], **rows[i])
    except Exception as e:  # noqa: BLE001 -- whatever fn raises is that row's failure
        return Failure("error", f"{type(e).__name__}: {e}", e)
    finally:
        if os.getpid() != me:  # fn forked and the child came back: it must not run our code
            os._exit(0)
    return checked_score(value)


#: What `per_sample` says to do about a thread left running.
POOL_FIX = (
    "pass pool=rb.rewards.ProcessPool(workers=n) to per_sample: each row then runs in a worker "
    "process, and a row past its deadline is killed"
)


class Abandoned:
    """The threads one reward function left running past their rows' deadlines (thread mode).

    Python cannot stop a thread: it runs on until ``fn`` returns, and one that spins slows the
    process for good. The first one is reported (a logging warning with ``fix``, once per
    reward function); `report` counts those still alive in ``{key}/abandoned_threads``.
    """

    def __init__(self, label: str, key: str, *, fix: str) -> None:
        self.label, self.metric, self.fix = label, f"{key}/abandoned_threads", fix
        self.threads: list[threading.Thread] = []
        self._warned = False

    def add(self, thread: threading.Thread, timeout: float) -> None:
        """``thread`` ran a row past ``timeout`` s and is left running."""
        self.threads.append(thread)
        if not self._warned:
            self._warned = True
            logger.warning(
                "reward %r: a row ran past its %g s deadline in thread mode, and Python cannot "
                "stop a thread: it keeps running (using CPU, holding what it holds) until the "
                "function returns, a spinning one slowing everything after it. The metric %s "
                "counts such threads still running; to stop them, %s. (Said once per reward "
                "function.)",
                self.label, timeout, self.metric, self.fix,
            )  # fmt: skip

    def report(self, metrics: dict[str, float]) -> None:
        """Set ``{key}/abandoned_threads``: the abandoned threads still running (the finished
        are forgotten). Only from the first one on: a reward that never timed out has no such
        metric."""
        if self._warned:
            self.threads = [t for t in self.threads if t.is_alive()]
            metrics[self.metric] = float(len(self.threads))


def _run_with_deadlines(
    score: Callable[[int], Outcome],
    n: int,
    *,
    timeout: float,
    max_workers: int,
    abandoned: Abandoned | None = None,
) -> list[Outcome]:
    """Score rows ``0..n-1`` on daemon threads; a row running past ``timeout`` s is abandoned
    (its thread handed to ``abandoned``)."""
    outcomes: list[Outcome | None] = [None] * n
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(n):
        todo.put(i)
    done: queue.SimpleQueue[tuple[int, Outcome]] = queue.SimpleQueue()
    running: dict[int, tuple[float, threading.Thread]] = {}  # row -> (start, thread) while fn runs
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            with lock:
                running[i] = (time.monotonic(), threading.current_thread())
            try:
                out = score(i)
            except BaseException as e:  # noqa: BLE001 -- a dead worker would lose the row silently
                out = Failure("error", f"{type(e).__name__}: {e}", e)
            with lock:
                running.pop(i, None)
            done.put((i, out))

    def start_worker() -> None:
        threading.Thread(target=worker, daemon=True, name="rlblocks-reward").start()

    for _ in range(min(max_workers, n)):
        start_worker()
    left = n
    while left:
        with lock:
            first_start = min((start for start, _ in running.values()), default=None)
        wait = timeout if first_start is None else first_start + timeout - time.monotonic()
        finished = _drain(done, wait=max(wait, 0.0))
        for i, out in finished:
            if outcomes[i] is None:  # else: a late result of an abandoned row, dropped
                outcomes[i], left = out, left - 1
        now = time.monotonic()
        with lock:  # rows still running now have run for at least `timeout` seconds
            overdue = [(i, thread) for i, (start, thread) in running.items()
                       if now - start >= timeout]  # fmt: skip
            for i, _ in overdue:
                del running[i]
        for i, thread in overdue:
            outcomes[i], left = Failure("timeout", f"no result after {timeout:g} s"), left - 1
            if abandoned is not None:
                abandoned.add(thread, timeout)
            start_worker()  # the stuck thread is abandoned: keep the remaining rows moving
    return outcomes  # type: ignore[return-value]  # every entry is set once `left` hits 0


def _drain(done: queue.SimpleQueue, *, wait: float) -> list[tuple[int, Outcome]]:
    """Block up to ``wait`` s for one finished row, then take every other one already there."""
    try:
        items = [done.get(timeout=wait)]
    except queue.Empty:
        return []
    while True:
        try:
            items.append(done.get_nowait())
        except queue.Empty:
            return items


def _summarize(
    outcomes: list[Outcome], *, fallback: float, key: str, label: str, raise_errors: bool
) -> RewardOutput:
    """Fallback scores for failed rows, the metrics, and one warning (or error) per batch."""
    failures = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, Failure)]
    if failures and raise_errors:
        i, first = failures[0]
        raise RewardRowError(f"reward {label!r}, row {i}: {first.message}") from first.error
    scores = [fallback if isinstance(o, Failure) else o for o in outcomes]
    rewards = torch.tensor(scores, dtype=torch.float32).reshape(len(scores))
    timeouts = sum(o.kind == "timeout" for _, o in failures)
    if failures:
        i, first = failures[0]
        text = (
            f"reward {label!r}: {len(failures)} of {len(outcomes)} rows failed ({timeouts} timed "
            f"out) and scored {fallback:g}; first: row {i}: {first.message}"
        )
        logger.warning("%s", text)
        note_failure(text)
    metrics = {
        f"{key}/mean": float(rewards.mean()) if len(scores) else 0.0,
        f"{key}/failures": float(len(failures)),
        f"{key}/timeouts": float(timeouts),
    }
    return RewardOutput(rewards, metrics)
