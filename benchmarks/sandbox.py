"""How many programs per second does the code sandbox run?

    python benchmarks/sandbox.py [--programs 64] [--workers 1 2] [--repeats 3]

Two programs, each run ``--programs`` times through `rlblocks.rewards.Sandbox` (every run a
fresh runner process, namespaces, tmpfs, limits, uid), ``workers`` at a time:

- **trivial**: ``print(1)``: the sandbox's own cost per run;
- **test suite**: a small solution (``is_prime`` and a ``fib`` with a loop) followed by 12
  ``assert`` lines, all in one program;
- **checked suite**: the same solution as the program and the 12 asserts as its ``test``, run
  in the checker process that asks the program for each value (``Sandbox.run(test=...)``), as
  the assert-style `code_reward` runs it.
- **floor**: ``python -I -c "print(1)"`` by `subprocess.run`, the same interpreter with no
  sandbox: what starting a process costs on this machine at that moment, so that the other
  rows can be read against it on a busy machine.

Each run's outcome is checked (``ok`` and finished, and the checker's ``passed`` where there
is a test; else the benchmark fails: a fast sandbox
that fails its programs would measure nothing). A row reports the median programs/s over
``--repeats`` rounds (the order of the settings rotates between rounds, so a busy spell of a
shared machine is spread over all of them), with the min and max, and the setup line says
the machine, the interpreter and which isolation held.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from rlblocks.rewards import sandbox_cgroup
from rlblocks.rewards.sandbox import Sandbox

TRIVIAL = "print(1)\n"
SUITE = """
def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True

def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

assert is_prime(2) and is_prime(3) and is_prime(97)
assert not is_prime(1) and not is_prime(91)
assert is_prime(7919)
assert not is_prime(7917)
assert fib(0) == 0
assert fib(1) == 1
assert fib(10) == 55
assert fib(20) == 6765
assert fib(30) == 832040
assert sum(is_prime(k) for k in range(100)) == 25
assert [fib(k) for k in range(6)] == [0, 1, 1, 2, 3, 5]
assert fib(90) == 2880067194370816120
"""
SOLUTION, ASSERTS = SUITE.split("\nassert ", 1)
PROGRAMS = {  # name: (program, test run by the checker or None)
    "trivial": (TRIVIAL, None),
    "test suite": (SUITE, None),
    "checked suite": (SOLUTION, "assert " + ASSERTS),
}


def rate(box: Sandbox, program: tuple[str, str | None], n: int) -> float:
    """Programs per second over ``n`` runs of ``(program, test)``; every run must pass."""
    source, test = program
    start = time.perf_counter()
    with ThreadPoolExecutor(box.workers) as ex:
        results = list(ex.map(lambda _: box.run(source, test=test), range(n)))
    seconds = time.perf_counter() - start
    bad = [r for r in results if r.outcome != "ok" or not r.finished or
           r.check != ("" if test is None else "passed")]  # fmt: skip
    if bad:
        raise RuntimeError(f"{len(bad)} of {n} runs failed; first: {bad[0]}")
    return n / seconds


def floor_rate(python: str, n: int, workers: int) -> float:
    """Programs per second starting ``python -I -c "print(1)"`` plainly, ``workers`` at once."""
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        command = [python, "-I", "-c", "print(1)"]
        done = list(
            ex.map(lambda _: subprocess.run(command, capture_output=True, check=False), range(n))
        )
    if any(d.returncode != 0 or d.stdout != b"1\n" for d in done):
        raise RuntimeError("the plain interpreter failed")
    return n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[tuple[str, int], float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", type=int, default=64, help="runs per measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    boxes = {w: Sandbox(workers=w) for w in args.workers}
    first = next(iter(boxes.values())).run(TRIVIAL)
    memory = sandbox_cgroup.available()
    load = os.getloadavg()  # other jobs on a shared machine: said beside the numbers
    settings = [(name, w) for name in (*PROGRAMS, "floor") for w in args.workers]
    for box in boxes.values():
        rate(box, PROGRAMS["trivial"], 2 * max(args.workers))  # warm the page cache
    rates: dict[tuple[str, int], list[float]] = {s: [] for s in settings}
    for r in range(args.repeats):
        for name, w in settings[r % len(settings) :] + settings[: r % len(settings)]:
            if name == "floor":
                rates[name, w].append(floor_rate(boxes[w].python, args.programs, w))
            else:
                rates[name, w].append(rate(boxes[w], PROGRAMS[name], args.programs))
    print(
        f"setup: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"Linux {platform.release()}, programs run by {boxes[args.workers[0]].python}, "
        f"isolation {first.isolation}, uid drop {os.geteuid() == 0}, "
        f"run memory by {f'cgroup v{memory}' if memory else 'pid 1 watch'}, "
        f"{args.programs} runs x {args.repeats} rounds per row, "
        f"load average before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}"
    )
    print("\n| program | workers | programs/s (median) | min | max |\n|---|---|---|---|---|")
    medians = {}
    for name, w in settings:
        values = rates[name, w]
        medians[name, w] = statistics.median(values)
        print(f"| {name} | {w} | {medians[name, w]:.1f} | {min(values):.1f} | {max(values):.1f} |")
    return medians


if __name__ == "__main__":
    main()
