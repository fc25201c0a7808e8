"""benchmarks/agent_rollout.py on the tiny model: it runs, and its row adds up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_agent_rollout_benchmark_on_the_tiny_model(capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_agent_rollout", ROOT / "benchmarks" / "agent_rollout.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    result = module.main(["--model", "tiny", "--prompts", "2", "--n", "2", "--max-new-tokens", "4"])
    assert result["episodes"] == 4 and result["engine_calls"] >= 1
    assert result["engine"] <= result["total"] and result["loop"] >= 0
    out = capsys.readouterr().out
    assert out.count("\n| 4 |") == 1 and "model tiny" in out
