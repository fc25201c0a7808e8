"""The main job, run on the tiny model: outputs are written and complete, its held-out set is
distinct and unseen, and what it trains shows in its held-out score (lr 0 changes nothing)."""

import json
import re
from pathlib import Path

import pytest
import torch
from toy_tasks import digit_fraction

import rlblocks as rb
from rlblocks.app import demo
from rlblocks.app.job import sft_completion
from rlblocks.tracking.runlog import read_metrics


def test_demo_smoke_run_writes_its_outputs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--steps", "2", "--eval-size", "4", "--group-size", "2"]
    summary = demo.main(
        [*argv, "--prompts-per-step", "2", "--max-new-tokens", "4", "--out", str(out)]
    )
    assert set(summary) == {
        *("before", "before_cut", "before_ended", "after", "after_cut", "after_ended"),
        *("steps", "held_out", "held_out_in_training", "train_minutes"),
    }
    assert summary["held_out_in_training"] == 0
    assert summary["held_out"] == 4 and summary["steps"] == 2
    # The tiny model's greedy answers run to the 4-token budget: all cut off, none ended.
    assert summary["before_cut"] == summary["after_cut"] == 1.0
    assert summary["before_ended"] is None and summary["after_ended"] is None
    assert json.loads((out / "summary.json").read_text()) == summary
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for key in ("reward/mean", "response_length", "clip_frac", "grad_norm", "time/update"):
        assert key in records[0], key
    assert "kl/token" not in records[0]  # --kl-coef 0: no reference model, nothing scored
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # The memory plan is printed before the model loads (its first line, then the first
    # progress output of the held-out evaluation).
    printed = capsys.readouterr().out
    assert printed.lstrip().startswith("memory plan of tiny: float32, full")
    assert "| **peak, trainer** |" in printed and "fits: peak" in printed


def test_demo_held_out_problems_are_distinct_unseen_and_the_same_for_every_seed():
    defaults = demo.parse_args([])
    assert defaults.eval_size >= 200
    task = demo.TASKS[defaults.task]
    held_out_prompts = []
    for seed in (0, 1, 2):
        train, held_out = demo.problems(task, eval_size=defaults.eval_size, seed=seed)
        expressions = [row.metadata["expression"] for row in held_out]
        assert len(set(expressions)) == len(expressions) == defaults.eval_size
        assert not set(expressions) & {row.metadata["expression"] for row in train}
        held_out_prompts.append(held_out.prompts)
    # Every seed is scored on the same problems; only the training data differ.
    assert held_out_prompts[0] == held_out_prompts[1] == held_out_prompts[2]
    assert train.prompts != demo.problems(task, eval_size=1, seed=0)[0].prompts  # seed 2 vs 0


# The learning check runs the main job on the tiny model with a task whose reward it can climb
# in a few steps: the arithmetic prompts, scored by the share of digits in the answer
# (toy_tasks.digit_fraction), so the held-out "accuracy" is the mean digit share of greedy
# answers. 4 prompts x 8 samples of at most 8 tokens, lr 1e-2, 10 steps: 4 s on one thread.
DIGITS = demo.Task(
    difficulty=1,
    instruction="Answer with just the number.",
    reward=rb.rewards.per_sample(digit_fraction, timeout=None),
)


def run_digits(tmp_path, monkeypatch, *, lr: float, seed: int = 0) -> dict:
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(demo.TASKS, "digits", DIGITS)
    argv = ["--model", "tiny", "--task", "digits", "--steps", "10", "--eval-size", "16"]
    argv += ["--prompts-per-step", "4", "--group-size", "8", "--max-new-tokens", "8"]
    argv += ["--checkpoint-every", "100", "--lr", str(lr), "--seed", str(seed)]
    return demo.main([*argv, "--out", str(tmp_path / f"run-{lr}-{seed}")])


def test_demo_at_lr_0_scores_the_same_model_before_and_after(tmp_path, monkeypatch):
    summary = run_digits(tmp_path, monkeypatch, lr=0.0)
    # lr 0: ten steps of rollouts and updates leave the weights as they were, and greedy decoding
    # is deterministic, so the two evaluations of the same 16 problems agree exactly.
    assert summary["after"] == summary["before"]


def test_demo_training_shows_in_the_held_out_score(tmp_path, monkeypatch):
    summary = run_digits(tmp_path, monkeypatch, lr=1e-2)
    # Measured (seeds 0-5): the tiny model's greedy answers hold no digit before training
    # (score 0.0; the lr-0 control above stays there) and only digits after 10 steps (1.0 for
    # every seed); after 5 steps 5 of the 6 seeds were at 1.0 already, seed 0 at 0.06. The bar
    # sits halfway between the control and the learned score, at twice those 5 steps.
    assert summary["before"] == 0.0
    assert summary["after"] > 0.5, summary


def test_demo_resumes_and_never_mixes_two_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--eval-size", "4", "--group-size", "2", "--out", str(out)]
    argv += ["--prompts-per-step", "2", "--max-new-tokens", "4"]
    with pytest.raises(SystemExit, match="holds no complete checkpoint"):
        demo.main([*argv, "--steps", "2", "--resume"])
    first = demo.main([*argv, "--steps", "2"])
    with pytest.raises(SystemExit, match="holds a run already .*: pass --resume"):
        demo.main([*argv, "--steps", "2"])
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]  # untouched
    summary = demo.main([*argv, "--steps", "3", "--resume"])  # one more step
    assert summary["before"] == first["before"] and summary["steps"] == 3
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["sync/version"] for r in records] == [1, 2, 3]  # the resharder's version goes on
    assert rb.checkpoint.Checkpointer(out / "checkpoints").steps() == [3]  # the newest only


def test_demo_with_a_kl_coefficient_keeps_a_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    argv = ["--model", "tiny", "--steps", "1", "--eval-size", "2", "--group-size", "2"]
    argv += ["--prompts-per-step", "2", "--max-new-tokens", "4", "--kl-coef", "0.1"]
    demo.main([*argv, "--out", str(tmp_path / "run")])
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["kl/token"] == 0.0  # π_old is the initial policy at step 0: k3 = 0 exactly
    assert "kl_loss" in record or "kl" in record


def test_demo_runs_one_step_off(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    argv = ["--model", "tiny", "--steps", "3", "--eval-size", "2", "--group-size", "2"]
    argv += ["--prompts-per-step", "2", "--max-new-tokens", "4", "--async"]
    threads = torch.get_num_threads()
    try:
        demo.main([*argv, "--out", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(threads)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["async/staleness"] for r in records] == [0.0, 1.0, 1.0]
    assert all(r["sync/bytes"] > 0 for r in records)  # the engine's own copy is synced
    # by default π_old is recomputed and the stale tokens masked (IcePop, RunOptions' default)
    assert all("mis/masked_frac" in r for r in records)
    demo.main([*argv, "--correction", "rollout", "--out", str(tmp_path / "rollout")])
    records = read_metrics(tmp_path / "rollout" / "metrics.jsonl")
    assert all(r["mismatch/abs_max"] == 0.0 for r in records)  # π_old: the engine's log-probs
    assert not any("mis/masked_frac" in r for r in records)
    with pytest.raises(SystemExit, match="--async and --staleness run with the in-process HF"):
        demo.main([*argv, "--workers", "2", "--out", str(tmp_path / "other")])


def test_demo_runs_two_steps_off_with_a_correction_and_a_held_out_curve(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    argv = ["--model", "tiny", "--steps", "4", "--eval-size", "3", "--group-size", "2"]
    argv += ["--prompts-per-step", "2", "--max-new-tokens", "4", "--staleness", "2"]
    argv += ["--correction", "icepop", "--eval-every", "2"]
    threads = torch.get_num_threads()
    try:
        summary = demo.main([*argv, "--out", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(threads)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["async/staleness"] for r in records] == [0.0, 1.0, 2.0, 2.0]
    assert all("mis/masked_frac" in r for r in records)  # the IcePop mask ran
    # π_old recomputed by the trainer (not the engine's log-probs: their gap is measured, by
    # staleness; tests/run/test_source.py checks the values)
    assert "mismatch/s2/abs_max" in records[2] and "mismatch/s1/abs_max" in records[1]
    seconds = [sum(r["step_seconds"] for r in records[:s]) for s in (0, 2, 4)]
    curve = summary["curve"]
    assert [(c["step"], c["seconds"]) for c in curve] == list(zip((0, 2, 4), seconds))
    assert curve[0]["accuracy"] == summary["before"] and curve[-1]["accuracy"] == summary["after"]
    assert 0.0 <= curve[1]["accuracy"] <= 1.0
    for bad, message in (
        (["--correction", "tis"], "--correction tis corrects for stale rollouts: pass"),
        (["--staleness", "-1"], "--staleness -1: pass 0"),
    ):
        with pytest.raises(SystemExit, match=message):
            demo.main([*bad, "--model", "tiny", "--out", str(tmp_path / "other")])


def test_demo_refuses_tp_without_workers_to_split_over(tmp_path):
    for argv in (["--tp", "2"], ["--tp", "2", "--workers", "3"]):
        with pytest.raises(SystemExit, match="--tp 2 splits the policy over Ray workers"):
            demo.main([*argv, "--model", "tiny", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()  # refused before --out is made


def test_demo_rejects_unknown_task():
    import pytest

    with pytest.raises(SystemExit):
        demo.parse_args(["--task", "chess"])


@pytest.mark.ray
@pytest.mark.slow  # about 20 s each: .ci/run runs them in its Ray step
@pytest.mark.parametrize("layout", [[], ["--tp", "2"]], ids=["fsdp", "tp2"])
def test_demo_runs_on_two_ray_workers(tmp_path, layout):
    out = tmp_path / "run"
    model = "tiny-mha" if layout else "tiny"  # two key-value heads split two ways
    argv = ["--model", model, "--steps", "2", "--eval-size", "4", "--group-size", "2", *layout]
    summary = demo.main(
        [
            *argv,
            "--prompts-per-step",
            "2",
            "--max-new-tokens",
            "4",
            "--workers",
            "2",
            "--out",
            str(out),
        ]
    )
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert [r["sync/version"] for r in records] == [1, 2]
    assert all(r["sync/bytes"] > 0 for r in records)  # two engine copies filled every step
    assert summary["steps"] == 2 and summary["held_out"] == 4


def test_demo_device_defaults_to_cuda_only_where_there_is_one(tmp_path, monkeypatch):
    import torch

    # The default --out (runs/demo) is relative: here it is this test's own folder, not the
    # checkout's, where the main job may have left a run.
    monkeypatch.chdir(tmp_path)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert demo.parse_args([]).device == expected
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device: device 'cuda' was asked for, but torch"):
            demo.main(["--model", "tiny", "--device", "cuda", "--steps", "1"])
        assert list(tmp_path.iterdir()) == []  # refused before --out was made


@pytest.mark.gpu
def test_demo_trains_on_the_gpu(tmp_path, monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--device", "cuda", "--steps", "2", "--eval-size", "4"]
    summary = demo.main([*argv, "--group-size", "2", "--max-new-tokens", "4", "--out", str(out)])
    assert summary["steps"] == 2
    records = read_metrics(out / "metrics.jsonl")
    assert all(r["optimizer_steps"] == 1.0 for r in records)  # the GPU step really updated


def sft_digits_argv(tmp_path, monkeypatch, *extra: str) -> list[str]:
    """The digits task on the tiny model with an SFT stage: the SFT targets are the problems'
    bare answers (``--sft-target answer``), all digits, so SFT alone teaches the reward."""
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(demo.TASKS, "digits", DIGITS)
    argv = ["--model", "tiny", "--task", "digits", "--eval-size", "16", "--lr", "1e-2"]
    argv += ["--sft-target", "answer"]
    return [*argv, "--prompts-per-step", "4", "--group-size", "8", "--max-new-tokens", "8", *extra]


def test_demo_sft_stage_hands_the_trained_model_to_grpo(tmp_path, monkeypatch):
    out = tmp_path / "run"
    argv = sft_digits_argv(tmp_path, monkeypatch, "--out", str(out), "--sft-steps", "40")
    summary = demo.main([*argv, "--steps", "1"])
    # Untrained, the greedy answers hold no digit (0.0, as in the tests above). SFT on the
    # answers (32 a step) first teaches EOS, the commonest target token: after 20 steps the
    # greedy answers were still empty (0.0), after 40 all digits (measured 1.0). The stage's
    # score is recorded and GRPO goes on from that model, not from the untrained one.
    assert summary["before"] == 0.0
    assert summary["after_sft"] > 0.5 and summary["after"] > 0.5, summary
    sft = [json.loads(line) for line in (out / "sft-metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sft] == list(range(40)) and sft[-1]["eval/nll"] < sft[0]["loss"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0]


def test_demo_resumes_a_run_whose_sft_stage_had_ended(tmp_path, monkeypatch):
    out = tmp_path / "run"
    argv = sft_digits_argv(tmp_path, monkeypatch, "--out", str(out), "--sft-steps", "40")
    first = demo.main([*argv, "--steps", "0"])  # killed, as it were, before GRPO's first step
    assert first["after_sft"] > 0.5
    # Resumed with lr 0: the SFT weights must come back from checkpoints-sft (nothing else
    # holds them), so the held-out score after GRPO equals the one after SFT.
    argv[argv.index("--lr") + 1] = "0.0"
    with pytest.warns(UserWarning):  # the configuration changed (lr): said, not refused
        summary = demo.main([*argv, "--steps", "1", "--resume"])
    assert summary["after_sft"] == first["after_sft"] == summary["after"]


def test_demo_distills_from_a_teacher_folder(tmp_path, monkeypatch):
    teacher = rb.models.save_tiny(tmp_path / "teacher", seed=1)
    out = tmp_path / "run"
    argv = sft_digits_argv(tmp_path, monkeypatch, "--out", str(out), "--teacher", str(teacher))
    summary = demo.main([*argv, "--steps", "2"])
    assert {"before", "teacher", "after"} <= set(summary)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["distill/reverse_kl"] > 0  # two different random models disagree


def test_demo_refuses_a_teacher_it_cannot_load_before_any_work(tmp_path, monkeypatch):
    out = tmp_path / "run"
    argv = sft_digits_argv(tmp_path, monkeypatch, "--out", str(out), "--steps", "1")
    with pytest.raises(SystemExit, match="teacher .*missing"):
        demo.main([*argv, "--teacher", str(tmp_path / "missing")])
    assert not (out / "summary.json").exists()  # nothing evaluated, nothing written


def test_demo_sft_targets_are_the_worked_answer_or_the_number():
    row = demo.problems(demo.TASKS["arithmetic"], eval_size=1, seed=0)[0][0]
    expression, answer = row.metadata["expression"], row.ground_truth
    assert eval(expression) == int(answer)
    assert sft_completion(row, "worked") == f"{expression} = {answer}"
    assert sft_completion(row, "answer") == answer


class FailsInSecondStep:
    """The digits reward, raising on its third call: the held-out evaluation before training
    and step 0 score, step 1 fails (before the first checkpoint, due every 5 steps)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, rollouts):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the reward fails")
        return DIGITS.reward(rollouts)


def test_demo_run_that_failed_before_its_first_checkpoint_is_run_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    failing = demo.Task(difficulty=1, instruction="", reward=FailsInSecondStep())
    monkeypatch.setitem(demo.TASKS, "failing", failing)
    monkeypatch.setitem(demo.TASKS, "digits", DIGITS)
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--eval-size", "4", "--group-size", "2", "--out", str(out)]
    argv += ["--prompts-per-step", "2", "--max-new-tokens", "4", "--checkpoint-every", "5"]
    with pytest.raises(RuntimeError, match="the reward fails"):
        demo.main([*argv, "--steps", "3", "--task", "failing"])
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0]  # never checkpointed
    assert rb.checkpoint.Checkpointer(out / "checkpoints").steps() == [0]  # the initial state
    summary = demo.main([*argv, "--steps", "3", "--task", "digits"])  # started over
    assert summary["steps"] == 3
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]


def test_the_docs_flag_table_is_the_parser():
    # docs/index.md lists every flag of the main job with its default and meaning, exactly as
    # the parser has them (it had lost 8 flags and described --task wrongly when written by
    # hand); --help shows each default.
    docs = (Path(__file__).resolve().parents[1] / "docs" / "index.md").read_text()
    assert demo.flag_table() in docs
    flags = {a.option_strings[0] for a in demo.parser()._actions if a.option_strings}
    listed = set(re.findall(r"^\| `(--[\w-]+)` \|", docs, flags=re.MULTILINE))
    assert listed == flags - {"-h"}
    assert "(default: 12)" in " ".join(demo.parser().format_help().split())


# A value for each flag other than its default (a flag whose key is a switch: set).
CHANGED = {
    "--model": "tiny",
    "--task": "arithmetic-hard",
    "--steps": "3",
    "--sft-steps": "2",
    "--sft-target": "answer",
    "--teacher": "/teacher",
    "--prompts-per-step": "3",
    "--group-size": "3",
    "--max-new-tokens": "9",
    "--lr": "0.5",
    "--overlong-shaping": "0.5",
    "--temperature": "0.5",
    "--instruction": "Reply in French.",
    "--updates-per-batch": "2",
    "--kl-coef": "0.5",
    "--eval-size": "9",
    "--validation": "9",
    "--seed": "9",
    "--out": "/elsewhere",
    "--checkpoint-every": "9",
    "--report-to": "tensorboard",
    "--engine": "vllm",
    "--staleness": "2",
    "--correction": "tis",
    "--eval-every": "3",
    "--workers": "2",
    "--tp": "2",
    "--device": "cuda",
}


def test_each_flag_sets_the_train_keys_the_table_names():
    # Change one flag alone and read which rlblocks-train keys change: exactly those of
    # FLAG_KEYS, which the docs' table shows (a new flag without its key fails here).
    def keys(argv):
        found = {}
        for arg in demo.train_argv(demo.parse_args(["--device", "cpu", *argv])):
            key, _, value = arg.removeprefix("--").partition("=")
            found[key] = value
        return found

    base = keys([])
    flags = {f for a in demo.parser()._actions for f in a.option_strings} - {"-h", "--help"}
    assert set(demo.FLAG_KEYS) == flags
    for flag in sorted(flags):
        changed = keys([flag] if flag in ("--resume", "--async") else [flag, CHANGED[flag]])
        moved = {k for k in base.keys() | changed.keys() if base.get(k) != changed.get(k)}
        named = {k.split(":")[0].strip() for k in demo.FLAG_KEYS[flag].split(",")}
        named = {k.removeprefix("--") for k in named}
        if flag == "--teacher":  # distillation has its own kl_coef: GRPO's is not given
            moved.discard("kl_coef")
        assert moved == named, (flag, moved, named)


def test_every_flag_of_the_main_job_in_the_docs_exists():
    # A flag named in the README or the docs after `python -m rlblocks` is one the parser
    # has (values may be placeholders there: --seed S).
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    flags = {f for a in demo.parser()._actions for f in a.option_strings}
    main_job = re.compile(r"python -m rlblocks(?![\w.])")  # not `python -m rlblocks.app.train`
    commands = [
        (page.relative_to(root), line)
        for page in pages
        for line in page.read_text().splitlines()
        if main_job.search(line)
    ]
    assert len(commands) >= 10, commands
    unknown = [
        (str(page), flag)
        for page, line in commands
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", main_job.split(line, 1)[1])
        if flag not in flags
    ]
    assert not unknown, unknown


def test_validation_problems_follow_the_held_out_ones_and_an_overlap_is_refused():
    task = demo.TASKS["arithmetic"]
    _, held_out = demo.problems(task, eval_size=256, seed=0)
    _, validation = demo.problems(task, eval_size=256, seed=3, validation=140)
    _, both = demo.problems(task, eval_size=396, seed=0)  # every distinct test expression
    assert validation.prompts == both.prompts[256:]  # the held-out set's continuation
    expressions = {m["expression"] for m in validation.metadata}
    assert len(expressions) == 140 and not expressions & {
        m["expression"] for m in held_out.metadata
    }
    demo.check_disjoint(validation, held_out)  # disjoint: no refusal
    keys = demo.problem_keys(task, eval_size=256, seed=0, validation=100)[1]
    overlapping = rb.data.arithmetic_prompts(**(keys | {"skip": 200}))  # rows 200-299
    with pytest.raises(SystemExit, match=r"--validation: 56 of the 100 validation problems are "):
        demo.check_disjoint(overlapping, held_out)


def test_validation_and_updates_per_batch_reach_the_run(tmp_path):
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--steps", "1", "--eval-size", "8", "--validation", "4",
            "--prompts-per-step", "2", "--group-size", "2", "--updates-per-batch", "2"]  # fmt: skip
    summary = demo.main([*argv, "--out", str(out)])
    assert summary["scored"] == "validation" and summary["held_out"] == 4
    assert json.loads((out / "summary.json").read_text())["scored"] == "validation"
    config = (out / "config.yaml").read_text()
    assert "mini_batch_size: 2\n" in config and "skip: 8\n" in config
    for bad, message in (
        (["--updates-per-batch", "3"], "--updates-per-batch 3: pass K >= 1 that divides the 4"),
        (["--validation", "-1"], "--validation -1: pass N >= 1"),
    ):
        with pytest.raises(SystemExit, match=message):
            demo.main([*argv, *bad, "--out", str(tmp_path / "other")])
    assert not (tmp_path / "other").exists()
