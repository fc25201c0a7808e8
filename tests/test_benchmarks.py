"""benchmarks/grpo_step.py on the tiny model: every system runs on equal shapes, the report prints.

Timings on the tiny model mean nothing; what is checked is the plumbing: the systems train,
their responses all have ``--max-new-tokens`` tokens (EOS held back), the prompt + response
token counts agree across systems, and the table has a row per system.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--steps", "2", "--repeats", "2", "--max-new-tokens", "4"]


def load_benchmark(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it is executed
    spec.loader.exec_module(module)
    return module


def table_rows(out: str) -> dict[str, list[str]]:
    """system -> its cells, from the markdown table the benchmark prints."""
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_grpo_step_floor_and_rlblocks_on_the_tiny_model(capsys):
    bench = load_benchmark("grpo_step")
    systems = ["floor", "rlblocks", "rlblocks-async"]
    medians = bench.main([*TINY, "--beta", "0.04", "--systems", *systems])
    out = capsys.readouterr().out
    assert list(medians) == systems and all(s > 0 for s in medians.values())
    rows = table_rows(out)
    assert list(rows) == systems
    tokens = {row[-2] for row in rows.values()}  # tok/step: prompt + response, same work
    assert len(tokens) == 1 and {row[-1] for row in rows.values()} == {"1"}  # one thread
    assert "rlblocks / floor: " in out
    assert "round 2: rlblocks, rlblocks-async, floor" in out  # the order rotates
    assert "trl / rlblocks-async" not in out  # no TRL row, no ratio to it


def test_grpo_step_refuses_unequal_response_lengths():
    bench = load_benchmark("grpo_step")
    two_prompts = ((1, 2),)  # a stand-in batch: only its length is read
    setup = bench.Setup("tiny", two_prompts, group_size=2, max_new_tokens=4, lr=0, beta=0, seed=0)
    step = bench.StepTime(1.0, {}, tokens=20, response_tokens=7, threads=1)  # 2 x 2 x 4 = 16
    with pytest.raises(RuntimeError, match=r"floor: \[7\] response tokens in a step, expected 16"):
        bench.check_shapes("floor", [step], setup)


@pytest.mark.slow
def test_grpo_step_trl_on_the_tiny_model(capsys):
    pytest.importorskip("trl")
    bench = load_benchmark("grpo_step")
    medians = bench.main([*TINY, "--repeats", "1", "--systems", "floor", "trl"])
    rows = table_rows(capsys.readouterr().out)
    assert set(medians) == {"floor", "trl"} and rows["trl"][-2] == rows["floor"][-2]
