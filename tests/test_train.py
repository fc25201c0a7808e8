"""``python -m rlblocks.app.train``: a YAML-configured run is the Python call it stands for (same
metrics, step by step), overrides win over the file, bad keys are named with their file and
line, and the saved ``config.yaml`` relaunches and resumes the same run."""

import json
import os
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from toy_tasks import digit_fraction

import rlblocks as rb
from rlblocks.app import demo, train
from rlblocks.tracking.runlog import read_metrics

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

# The tiny model, 2 steps of 2 prompts x 4 samples of at most 6 tokens. The reward is the share
# of digits (toy_tasks), named by its dotted path: dense, so the groups' rewards differ and the
# loss and gradient are not 0 (the math_answer reward of the untrained tiny model is 0 for all).
CONFIG = """\
recipe: grpo
steps: 2
group_size: 4
prompts_per_step: 2
seed: 3
checkpoint_every: 1
model:
  name: tiny
  device: cpu
trainer:
  lr: 1.0e-2
  micro_batch_size: 4
sampling:
  max_new_tokens: 6
engine:
  chat: true
data:
  name: arithmetic
  n: 16
  instruction: Answer with just the number.
  chat: true
reward: test_train:DIGITS
loss:
  name: clipped_surrogate
  clip: [0.2, 0.28]
"""

DIGITS = rb.rewards.per_sample(digit_fraction, timeout=None)


def failing_reward(rollouts):
    """A reward that raises: the run fails in its first step."""
    raise RuntimeError("the reward fails")


def python_call() -> list[dict]:
    """What CONFIG stands for, written out in Python."""
    torch.manual_seed(3)
    policy = rb.trainer.PolicyTrainer.from_pretrained(
        "tiny", device="cpu", lr=1e-2, micro_batch_size=4, reference=None
    )
    engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True, progress=False)
    data = rb.data.arithmetic_prompts(16, instruction="Answer with just the number.", chat=True)
    return rb.recipes.grpo(
        policy,
        engine,
        DIGITS,
        rb.data.PromptBatches(data, prompts_per_step=2, seed=3),
        steps=2,
        group_size=4,
        sampling=rb.SamplingParams(max_new_tokens=6),
        loss_fn=partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28)),
        run=rb.run.RunOptions(progress=False),
    )


def measured(history: list[dict]) -> list[dict]:
    """The metrics without wall-clock times and rates (which differ from run to run)."""
    timed = ("time/", "seconds", "per_second")
    return [
        {k: v for k, v in record.items() if not any(word in k for word in timed)}
        for record in history
    ]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return path


def test_yaml_run_and_its_saved_config_reproduce_the_python_call(tmp_path, config_file):
    from_yaml = train.main([str(config_file), "--out", str(tmp_path / "a")])
    expected = measured(python_call())
    assert len(from_yaml) == 2
    assert measured(from_yaml) == expected
    assert any(r["grad_norm"] > 0 for r in expected)  # the updates did something to compare
    saved = tmp_path / "a" / "config.yaml"
    assert "reward: test_train:DIGITS" in saved.read_text()
    again = train.main([str(saved), "--out", str(tmp_path / "b")])  # relaunched from the file
    assert measured(again) == expected
    assert (tmp_path / "b" / "config.yaml").read_text() == saved.read_text().replace(
        str(tmp_path / "a"), str(tmp_path / "b")
    )


def test_resume_from_the_saved_config_goes_on_like_the_whole_run(tmp_path, config_file):
    whole = train.main([str(config_file), "--out", str(tmp_path / "whole")])
    train.main([str(config_file), "--out", str(tmp_path / "cut"), "--steps", "1"])
    saved = tmp_path / "cut" / "config.yaml"
    with pytest.raises(SystemExit, match="holds a run already"):
        train.main([str(saved)])
    resumed = train.main([str(saved), "--steps", "2", "--resume"])
    assert measured(resumed)[-1] == measured(whole)[-1]


def test_a_resume_with_a_lower_lr_trains_at_it_and_config_yaml_says_so(tmp_path, config_file):
    out = tmp_path / "run"
    train.main([str(config_file), "--out", str(out), "--steps", "1"])
    saved = out / "config.yaml"
    with pytest.warns(UserWarning, match=r"policy_config\.lr 0\.01 -> 0\.001"):
        lowered = train.main([str(saved), "--steps", "2", "--resume", "--trainer.lr", "1e-3"])
    assert [h["lr"] for h in lowered] == [1e-2, 1e-3]  # the asked lr from the resumed step on
    assert yaml.safe_load(saved.read_text())["trainer"]["lr"] == 1e-3  # what is in effect
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = train.main([str(saved), "--steps", "3", "--resume"])  # from the rewritten file
    assert [h["lr"] for h in again] == [1e-2, 1e-3, 1e-3]
    assert not [w for w in caught if "changed settings" in str(w.message)]  # nothing changed


def test_a_refused_resume_leaves_config_yaml_as_it_was(tmp_path, config_file):
    out = tmp_path / "run"
    train.main([str(config_file), "--out", str(out), "--steps", "1"])
    before = (out / "config.yaml").read_text()
    with pytest.raises(ValueError, match=r"saved prompts_per_step=2, this one has 4"):
        train.main(
            [str(out / "config.yaml"), "--steps", "2", "--resume", "--prompts_per_step", "4"]
        )
    assert (out / "config.yaml").read_text() == before


def test_a_run_that_failed_in_its_first_step_is_run_again(tmp_path, config_file):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="the reward fails"):
        train.main([str(config_file), "--out", str(out), "--reward", "test_train:failing_reward"])
    saved = out / "config.yaml"
    assert "reward: test_train:failing_reward" in saved.read_text()  # the run had started
    with pytest.raises(RuntimeError, match="the reward fails"):  # resumed from step 0: fails again
        train.main([str(saved), "--resume"])
    history = train.main([str(saved), "--reward", "test_train:DIGITS"])  # fixed, run again
    assert len(history) == 2 and [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
    assert "reward: test_train:DIGITS" in saved.read_text()


def test_command_line_overrides_the_file(config_file):
    config, _, resume = train.parse([str(config_file), "--trainer.lr", "0.5", "--steps=7"])
    assert (config.trainer.lr, config.steps, resume) == (0.5, 7, False)
    assert config.trainer.micro_batch_size == 4  # the file's value, untouched
    config, _, _ = train.parse([str(config_file), "--loss.name", "gspo", "--recipe", "remax"])
    assert config.recipe == "remax" and "loss" in config  # remax takes a loss_fn
    assert "advantage" not in config  # ... but no advantage estimator
    # One vocabulary: PPO takes the file's group_size as GRPO does (it was samples_per_prompt,
    # which this line checked was refused); a section a recipe does not take is still named
    # with its file and line: DAPO has its own clip, no loss section.
    config, _, _ = train.parse([str(config_file), "--recipe", "ppo"])
    assert config.recipe == "ppo" and config.group_size == 4
    with pytest.raises(SystemExit, match=r"line 24: Option 'loss.name' is not accepted"):
        train.parse([str(config_file), "--recipe", "dapo"])


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("  n: 16\n", "  n: 16\n  bogus: 1\n", r"run.yaml, line 20: .*'data'.*'bogus'"),
        ("steps: 2\n", "stepz: 2\n", r"run.yaml, line 2: .*'stepz'"),
        ("steps: 2\n", "steps: two\n", r"run.yaml, line 2: .*\"steps\".*int"),
        ("  lr: 1.0e-2\n", "  lr: fast\n", r"run.yaml, line 11: .*\"trainer.lr\".*float"),
        ("  clip: [0.2, 0.28]", "  clip: [0.2, x]", r"run.yaml, line 25: .*\"loss.clip\""),
        ("max_new_tokens: 6", "max_new_tokens: 0", r"line 14: sampling: .*max_new_tokens"),
        ("recipe: grpo", "recipe: grpp", r"recipe: unknown name 'grpp'"),
        ("name: arithmetic", "name: arith", r"data.name: unknown name 'arith'"),
        # a section written as null (it ended in an AttributeError or a TypeError)
        (
            "trainer:\n  lr: 1.0e-2\n  micro_batch_size: 4\n",
            "trainer: null\n",
            (
                r"run.yaml, line 10: trainer: null; a section is a mapping of its keys: leave it "
                r"out, or write trainer: \{\}, for its defaults"
            ),
        ),
        ("model:\n  name: tiny\n  device: cpu\n", "model: null\n", r"line 7: model: null"),
        ("sampling:\n  max_new_tokens: 6\n", "sampling:\n", r"line 13: sampling: null"),
        ("engine:\n  chat: true\n", "engine: ~\n", r"line 15: engine: null"),
        (
            "loss:\n  name: clipped_surrogate\n  clip: [0.2, 0.28]\n",
            "loss: null\n",
            r"line 23: loss: null",
        ),
    ],
)
def test_bad_keys_and_values_are_named_with_file_and_line(config_file, old, new, message):
    assert old in CONFIG
    config_file.write_text(CONFIG.replace(old, new))
    with pytest.raises(SystemExit, match="(?s)" + message):
        train.parse([str(config_file)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_an_absent_device_is_refused_at_parse_time_with_its_line(config_file):
    # Refused by parse, before build loads the model: what torch sees and the fix.
    config_file.write_text(CONFIG.replace("device: cpu", "device: cuda:1"))
    with pytest.raises(SystemExit, match=r"run.yaml, line 9: model.device: device 'cuda:1' was"):
        train.parse([str(config_file)])
    with pytest.raises(SystemExit, match=r"command line: model.device: .*leave device out"):
        train.parse([str(config_file), "--model.device", "cuda"])


def test_bad_overrides_are_named_as_the_command_line(config_file):
    with pytest.raises(SystemExit, match=r"(?s)command line: .*\"trainer.lr\""):
        train.parse([str(config_file), "--trainer.lr", "fast"])
    with pytest.raises(SystemExit, match=r"command line: unrecognized .*--trainer.lrr"):
        train.parse([str(config_file), "--trainer.lrr", "1"])


def test_examples_parse(tmp_path):
    assert {p.name for p in EXAMPLES} >= {"grpo_arithmetic.yaml"} and len(EXAMPLES) >= 2
    for path in EXAMPLES:
        config, _, _ = train.parse([str(path)])
        assert config.recipe in train.RECIPES, path


def flat(section: dict, prefix: str = "") -> dict:
    """A parsed config as ``{"trainer.lr": ..., ...}``."""
    keys = {}
    for key, value in section.items():
        if isinstance(value, dict):
            keys |= flat(value, f"{prefix}{key}.")
        else:
            keys[prefix + key] = value
    return keys


def test_the_main_job_is_the_yaml_config_of_rlblocks_train():
    # python -m rlblocks runs rlblocks-train with the keys of its flags (demo.train_argv):
    # with the defaults they are examples/grpo_arithmetic.yaml's, key for key, but the output
    # folder; and its held-out problems are the demo's 256 (compared as prompts).
    main_job = ROOT / "examples" / "grpo_arithmetic.yaml"
    from_file, _, _ = train.parse([str(main_job), "--model.device", "cpu"])
    from_flags, _, _ = train.parse(demo.train_argv(demo.parse_args(["--device", "cpu"])))
    keys = [flat(config.as_dict()) for config in (from_file, from_flags)]
    differ = {k for k in keys[0].keys() | keys[1].keys() if keys[0].get(k) != keys[1].get(k)}
    assert differ == {"config", "out"}, {k: (keys[0].get(k), keys[1].get(k)) for k in differ}
    assert len(keys[0]) > 60  # every key of the run, not a handful
    _, demo_held_out = demo.problems(demo.TASKS["arithmetic"], eval_size=256, seed=0)
    eval_kwargs = {k: v for k, v in vars(from_file.eval).items() if k != "name"}
    assert rb.data.arithmetic_prompts(**eval_kwargs).prompts == demo_held_out.prompts
    # A flag sets its key: --lr is trainer.lr, --eval-size eval.n, --async staleness 1.
    flags = ["--lr", "1e-4", "--eval-size", "8", "--async", "--teacher", "/t", "--tp", "2"]
    argv = demo.train_argv(demo.parse_args(flags))
    for key in ("--trainer.lr=0.0001", "--eval.n=8", "--staleness=1", "--recipe=distill"):
        assert key in argv, key
    assert "--teacher=/t" in argv and "--trainer.tp=2" in argv


EVAL = """\
eval:
  name: arithmetic
  n: 4
  split: test
  distinct: true
  instruction: Answer with just the number.
  chat: true
"""


def test_an_eval_section_scores_before_and_after_and_a_resume_keeps_before(tmp_path, config_file):
    config_file.write_text(CONFIG + EVAL)
    out = tmp_path / "run"
    train.main([str(config_file), "--out", str(out)])
    first = json.loads((out / "summary.json").read_text())
    assert {"before", "before_cut", "after", "after_cut", "train_minutes"} <= set(first)
    assert (first["steps"], first["held_out"], first["held_out_in_training"]) == (2, 4, 0)
    # A resume to step 3 reads "before" from the file (the untrained weights are gone) and
    # scores the weights after step 3.
    before = {k: v for k, v in first.items() if k.startswith("before")}
    (out / "summary.json").write_text(json.dumps({**first, "before": 0.5}))  # marks the read
    train.main([str(config_file), "--out", str(out), "--steps", "3", "--resume"])
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["before"] == 0.5 and resumed["steps"] == 3
    assert {k: resumed[k] for k in before if k != "before"} == {
        k: v for k, v in before.items() if k != "before"
    }


def test_a_named_correction_two_steps_off_and_a_held_out_curve(tmp_path, config_file):
    # correction: tis is RunOptions(correction=TruncatedIS(cap=2)): its metrics are in every
    # step's record; eval_every: 2 scores the weights kept after step 2 once training ended.
    config_file.write_text(CONFIG + EVAL)
    out = tmp_path / "run"
    args = [str(config_file), "--out", str(out), "--steps", "4", "--staleness", "2"]
    history = train.main([*args, "--correction", "tis", "--eval_every", "2"])
    assert [h["async/staleness"] for h in history] == [0.0, 1.0, 2.0, 2.0]
    assert all("tis/capped_frac" in h and "mis/masked_frac" not in h for h in history)
    summary = json.loads((out / "summary.json").read_text())
    records = read_metrics(out / "metrics.jsonl")
    seconds = [sum(r["step_seconds"] for r in records[:s]) for s in (0, 2, 4)]
    curve = summary["curve"]
    assert [(c["step"], c["seconds"]) for c in curve] == list(zip((0, 2, 4), seconds))
    assert curve[0]["accuracy"] == summary["before"] and curve[-1]["accuracy"] == summary["after"]
    assert 0.0 <= curve[1]["accuracy"] <= 1.0
    assert "correction: tis" in (out / "config.yaml").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--correction", "tis"], "correction: tis corrects for stale rollouts; pass staleness"),
        (
            ["--staleness", "1", "--correction", "rollout", "--old_logprobs", "recompute"],
            "old_logprobs: recompute, but correction rollout takes pi_old from rollout",
        ),
        (["--eval_every", "2"], "eval_every: 2 needs an eval section"),
        # sequence parallelism in one process was run with sp dropped (tp was refused already)
        (["--trainer.sp", "2"], r"trainer.sp: 2 splits each micro-batch over Ray workers"),
        (["--trainer.sp", "2", "--workers", "3"], r"a multiple of 2 \(got 3\)"),
        (["--trainer.tp", "2"], r"trainer.tp: 2 splits the policy over Ray workers"),
    ],
)
def test_settings_that_cannot_go_together_are_refused_at_parse_time(config_file, extra, message):
    with pytest.raises(SystemExit, match=message):
        train.parse([str(config_file), *extra])


def test_held_out_problems_that_are_training_prompts_are_counted(tmp_path, config_file):
    # The eval section drawn from the training split: each problem that is also one of the
    # run's 16 training prompts is counted (found here by comparing the two draws).
    config_file.write_text(CONFIG + EVAL.replace("split: test", "split: train"))
    config, _, _ = train.parse([str(config_file)])
    training = rb.data.arithmetic_prompts(16, instruction="Answer with just the number.", chat=True)
    held_out = rb.data.arithmetic_prompts(
        4, split="train", distinct=True, instruction="Answer with just the number.", chat=True
    )
    expected = sum(p in training.prompts for p in held_out.prompts)
    assert expected >= 1  # the two draws share problems: the count is not vacuous
    _, arguments = train.build(config)
    assert train.held_out_of(config, arguments).in_training == expected


def test_a_yaml_run_goes_one_step_off_with_its_own_engine_copy(tmp_path, config_file):
    # staleness: 1 in the file is RunOptions(staleness=1): the engine gets its own copy of the
    # weights (sharing the trainer's module is refused one step off) and batches 2.. are stale.
    args = [str(config_file), "--staleness", "1", "--out", str(tmp_path / "run")]
    history = train.main([*args, "--steps", "3"])
    assert [h["async/staleness"] for h in history] == [0.0, 1.0, 1.0]
    assert "staleness: 1" in (tmp_path / "run" / "config.yaml").read_text()


@pytest.mark.parametrize(("name", "reference"), [("dpo", True), ("simpo", False)])
def test_online_dpo_example_builds_its_pair_loss_and_a_reference_only_when_needed(name, reference):
    config, _, _ = train.parse(
        [str(ROOT / "examples" / "online_dpo_arithmetic.yaml"), "--model.name", "tiny"]
        + ["--preference.name", name]
    )
    fn, arguments = train.build(config)
    assert fn is rb.recipes.online_dpo
    assert arguments["preference"].func is getattr(rb.losses, name)
    assert arguments["preference"].keywords["beta"] == 0.1  # the file's, kept across names
    assert (arguments["policy"].reference is not None) is reference


def test_the_console_script_exits_0_after_a_run(tmp_path, config_file):
    # The rlblocks-train entry point, called as pip's console-script wrapper calls it:
    # sys.exit(function()). Before, the entry point was main, whose list of metrics made the
    # exit status 1 (and printed the list) after every successful run.
    call = (
        "import sys; from importlib.metadata import entry_points; "
        "(script,) = entry_points(group='console_scripts', name='rlblocks-train'); "
        f"sys.argv = ['rlblocks-train', {str(config_file)!r}, '--out', {str(tmp_path / 'out')!r}]; "
        "sys.exit(script.load()())"
    )
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", call], check=False, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(read_metrics(tmp_path / "out" / "metrics.jsonl")) == 2


def test_overlong_shaping_adds_dapos_ramp_to_the_training_reward(config_file):
    # max_new_tokens 6 (the file's): L_max 6, L_cache 3; lengths 3, 5, 6 lose 0, 2/3, 1 of the
    # factor 0.5 (DAPO eq. 13: ((L_max - L_cache) - |y|) / L_cache, clamped to [-1, 0]).
    config, _, _ = train.parse([str(config_file), "--overlong_shaping", "0.5"])
    rollouts = rb.Rollouts.from_lists([[1]] * 3, [[7] * 3, [7] * 5, [7] * 6])
    rollouts = rollouts.replace(metadata=[{"ground_truth": "7"}] * 3)
    task = rb.rewards.math_answer
    rewards, metrics = train.shaped(task, config)(rollouts)
    assert torch.allclose(rewards, task(rollouts)[0] - 0.5 * torch.tensor([0.0, 2 / 3, 1.0]))
    assert metrics["overlong/weight"] == 0.5 and "task/mean" in metrics
    unshaped, _, _ = train.parse([str(config_file)])
    assert train.shaped(task, unshaped) is task  # 0: the reward itself
    with pytest.raises(SystemExit, match=r"overlong_shaping: -1.0; pass a factor >= 0"):
        train.parse([str(config_file), "--overlong_shaping", "-1"])
    dapo = CONFIG.replace("loss:\n  name: clipped_surrogate\n  clip: [0.2, 0.28]\n", "")
    config_file.write_text(dapo.replace("recipe: grpo", "recipe: dapo"))
    train.parse([str(config_file)])  # DAPO without shaping parses
    with pytest.raises(SystemExit, match=r"recipe dapo shapes its reward itself: set overlong_f"):
        train.parse([str(config_file), "--overlong_shaping", "1"])


def test_dr_grpo_aggregation_divides_by_the_token_budget_not_the_padded_width(config_file):
    # seq-mean-token-sum-norm by name gets C = sampling.max_new_tokens (6 in the file): a
    # micro-batch whose responses are padded to 4 tokens is divided by 2 sequences x 6, not x 4.
    config, _, _ = train.parse(
        [str(config_file), "--trainer.aggregation", "seq-mean-token-sum-norm"]
    )
    policy = train.build(config)[1]["policy"]
    aggregation = policy.config.aggregation
    assert aggregation == rb.losses.SeqMeanTokenSumNorm(max_tokens=6)
    assert aggregation.normalizer(torch.ones(2, 4)) == 12.0
    token_mean, _, _ = train.parse([str(config_file)])  # other modes are kept as named
    assert train.build(token_mean)[1]["policy"].config.aggregation is rb.losses.token_mean


def test_a_run_refuses_an_out_folder_whose_files_it_did_not_write(tmp_path, config_file):
    # A user's own config.yaml and curves.png in the folder named as out: the run used to write
    # over both and exit 0 (only metrics.jsonl and checkpoints/ were guarded).
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my own settings\n")
    (out / "curves.png").write_bytes(b"my own figure")
    with pytest.raises(SystemExit, match=r"mine holds config.yaml, curves.png, which no rlblocks"):
        train.main([str(config_file), "--out", str(out), "--steps", "1"])
    assert (out / "config.yaml").read_text() == "my own settings\n"
    assert (out / "curves.png").read_bytes() == b"my own figure"
    # A folder a run made is the run's: it is claimed, and a later run there (a resume with
    # more steps) rewrites its config.yaml.
    ours = tmp_path / "ours"
    train.main([str(config_file), "--out", str(ours), "--steps", "1"])
    assert (ours / train.MARK).exists() and "steps: 1\n" in (ours / "config.yaml").read_text()
    assert len(train.main([str(config_file), "--out", str(ours), "--steps", "2", "--resume"])) == 2
    assert "steps: 2\n" in (ours / "config.yaml").read_text()
