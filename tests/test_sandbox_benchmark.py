"""benchmarks/sandbox.py runs end to end and prints a row per program and worker count.

Timings mean nothing here (2 runs each); what is checked is that the benchmark's programs pass
in the sandbox (it refuses to time failing runs) and that the table and setup line print.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/net"), reason="Linux only")
def test_sandbox_benchmark_prints_its_table(capsys) -> None:
    spec = importlib.util.spec_from_file_location("bench_sandbox", ROOT / "benchmarks/sandbox.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    rates = bench.main(["--programs", "2", "--repeats", "1", "--workers", "1", "2"])
    out = capsys.readouterr().out
    names = [(p, w) for p in ("trivial", "test suite", "checked suite", "floor") for w in (1, 2)]
    assert list(rates) == names and all(r > 0 for r in rates.values())
    assert "setup: " in out and "load average before" in out
    assert (
        sum(
            line.startswith(("| trivial", "| test suite", "| checked suite", "| floor"))
            for line in out.splitlines()
        )
        == 8
    )
