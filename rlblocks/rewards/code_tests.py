"""`code_reward`: score a completion's program by running its tests in the `Sandbox`.

Each row's ``metadata[tests_key]`` holds its tests, in one of two styles:

- **stdin/stdout**: ``[{"input": "1 2\\n", "output": "3"}, ...]`` (or APPS/TACO's
  ``{"inputs": [...], "outputs": [...]}``): the program runs once per case with ``input`` on
  stdin; the case passes when the program ends normally (exit 0) and its stdout equals
  ``output`` after dropping trailing spaces on every line and blank lines at both ends;
- **assert**: ``"assert f(2) == 4"`` or a list of such snippets: the program runs once per
  snippet, then the snippet runs in a checker process of the `Sandbox` that never holds a
  program object (`sandbox_check`): it asks the program for ``f(2)`` and gets plain data
  back, so ``==`` is the checker's own, an object whose ``__eq__`` always returns True fails
  (comparing a program object raises ``TypeError``: ``error``), and the verdict comes on a
  pipe the program does not hold. A program that ends before answering (``sys.exit(0)``)
  fails. On a `RemoteSandbox` the snippet is appended to the program and passes when the
  file runs to its last line: there, a program can forge that (see `remote_sandbox`).

The reward of row i is the fraction of its tests that passed, or with ``all_or_nothing`` 1.0
when all passed and 0.0 otherwise (its tests then stop at the first failure). Rows with the
same program and tests (common within a GRPO group) run once; ``{key}/runs`` counts the
programs really run. Every test of every row is counted by outcome in the metrics:
``{key}/passed``, ``failed`` (wrong output, failed assert), ``error`` (an exception or a
non-zero exit), ``timeout``, ``memory``, ``crashed`` (a signal), ``output`` (stdout too large)
and ``sandbox_error`` (the sandbox failed: logged, scored 0).
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor

import torch

from rlblocks.interfaces import RewardFn, RewardOutput
from rlblocks.rewards.remote_sandbox import RemoteSandbox
from rlblocks.rewards.sandbox import RunResult, Sandbox

logger = logging.getLogger(__name__)

TEST_OUTCOMES = ("passed", "failed", "error", "timeout", "memory", "crashed", "output")
_FENCE = re.compile(r"^```[ \t]*([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def extract_program(completion: str) -> str:
    """The program in a completion: the last fenced block tagged ``python``/``py``/``python3``;
    else the last untagged fenced block; else the whole completion.

    A fence must open and close on lines of their own; a block cut off by the length limit
    (no closing fence) is not a block.
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(completion)]
    for wanted in (("python", "py", "python3"), ("",)):
        tagged = [body for tag, body in blocks if tag in wanted]
        if tagged:
            return tagged[-1]
    return completion


def code_reward(
    *,
    sandbox: Sandbox | RemoteSandbox | None = None,
    tests_key: str = "tests",
    all_or_nothing: bool = False,
    key: str = "reward",
) -> RewardFn:
    """Batch `RewardFn`: rᵢ = passed testsᵢ / testsᵢ (or 1[all passed]), (b) float32, no grad.

    ``sandbox``: where programs run (default ``Sandbox()``: its limits, 2 at once), or a
    `RemoteSandbox` service.
    A row without tests, or with tests in neither style, is a `ValueError` naming the row.
    """
    box = Sandbox() if sandbox is None else sandbox

    def code_tests(rollouts, /) -> RewardOutput:
        programs = [extract_program(c) for c in rollouts.completions]
        rows = [_tests_of(meta, i, tests_key) for i, meta in enumerate(rollouts.metadata)]
        # Rows with the same program and tests (common within a group) run once.
        first: dict[tuple, int] = {}
        same_as = [
            first.setdefault((p, tuple(t)), i) for i, (p, t) in enumerate(zip(programs, rows))
        ]
        todo = sorted(set(same_as))
        if all_or_nothing:  # one task per row: its tests stop at the first failure
            tasks = [[(i, t) for t in range(len(rows[i]))] for i in todo]
        else:  # one task per test: all of them run, spread over the workers
            tasks = [[(i, t)] for i in todo for t in range(len(rows[i]))]

        def run_task(task: list[tuple[int, int]]) -> list[tuple[int, str, RunResult]]:
            done = []
            for i, t in task:
                outcome, result = _run_test(box, programs[i], rows[i][t])
                done.append((i, outcome, result))
                if outcome != "passed":
                    break
            return done

        with ThreadPoolExecutor(box.workers, thread_name_prefix="rlblocks-code") as ex:
            runs = [run for runs in ex.map(run_task, tasks) for run in runs]
        by_row: dict[int, list[tuple[int, str, RunResult]]] = {i: [] for i in todo}
        for run in runs:
            by_row[run[0]].append(run)
        tests = [
            (i, outcome, result) for i, j in enumerate(same_as) for _, outcome, result in by_row[j]
        ]
        return _summarize(tests, rows, runs=len(runs), all_or_nothing=all_or_nothing, key=key)

    code_tests.__doc__ = "Sandboxed code reward (`code_reward`)."
    return code_tests


def _tests_of(meta: dict, i: int, tests_key: str) -> list[tuple[str, str | None]]:
    """Row ``i``'s tests as ``(stdin or appended code, expected stdout or None)``."""
    tests = meta.get(tests_key)
    if isinstance(tests, dict) and {"inputs", "outputs"} <= tests.keys():
        tests = [{"input": a, "output": b} for a, b in zip(tests["inputs"], tests["outputs"])]
    if isinstance(tests, str):
        tests = [tests]
    if isinstance(tests, list) and tests:
        if all(isinstance(t, str) for t in tests):
            return [(t, None) for t in tests]
        if all(isinstance(t, dict) and {"input", "output"} <= t.keys() for t in tests):
            return [(str(t["input"]), str(t["output"])) for t in tests]
    raise ValueError(
        f"code_reward: row {i}: metadata[{tests_key!r}] must be a non-empty list of "
        f'{{"input", "output"}} cases or of assert snippets, got {str(tests)[:200]!r}; give '
        "every row its tests"
    )


def _run_test(
    box: Sandbox | RemoteSandbox, program: str, test: tuple[str, str | None]
) -> tuple[str, RunResult]:
    """Run one test; its outcome is one of `TEST_OUTCOMES` or ``sandbox_error``."""
    code_or_input, expected = test
    if expected is None and isinstance(box, Sandbox):  # assert style, checked apart
        result = box.run(program, test=code_or_input)
        if result.outcome == "ok":
            verdict = result.check.partition(" ")[0] or "failed"  # no verdict: not passed
            return verdict, result
    elif expected is None:  # assert style on a service: the snippet after the program
        result = box.run(f"{program}\n\n{code_or_input}\n")
        if result.outcome in ("ok", "assertion"):
            return ("passed" if result.outcome == "ok" and result.finished else "failed"), result
    else:
        result = box.run(program, code_or_input)
        if result.outcome == "ok":
            return ("passed" if _same_output(result.stdout, expected) else "failed"), result
        if result.outcome == "assertion":
            return "error", result
    return result.outcome, result


def _same_output(got: str, expected: str) -> bool:
    def clean(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return clean(got) == clean(expected)


def _summarize(
    tests: list[tuple[int, str, RunResult]], rows: list[list], *, runs: int,
    all_or_nothing: bool, key: str,
) -> RewardOutput:  # fmt: skip
    """Scores and metrics from each row's test outcomes; ``runs``: programs really run."""
    passed = [0] * len(rows)
    counts = dict.fromkeys((*TEST_OUTCOMES, "sandbox_error"), 0)
    for i, outcome, result in tests:
        passed[i] += outcome == "passed"
        counts[outcome] += 1
        if outcome == "sandbox_error":
            logger.warning("code_reward: row %d: the sandbox failed: %s", i, result.detail)
    scores = [
        float(p == len(tests)) if all_or_nothing else p / len(tests)
        for p, tests in zip(passed, rows)
    ]
    rewards = torch.tensor(scores, dtype=torch.float32).reshape(len(scores))
    metrics = {f"{key}/mean": float(rewards.mean()) if scores else 0.0}
    metrics |= {f"{key}/{name}": float(n) for name, n in counts.items()}
    metrics[f"{key}/runs"] = float(runs)
    return RewardOutput(rewards, metrics)
