"""Silent no-learning is reported where it happens: groups of one, transposed advantages, a
model broken by a too-large update; and refused before the first step where it is certain:
non-positive steps (every recipe and the CLI), online DPO without pairs."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import count_prompts, digit_examples, digit_fraction

import rlblocks as rb
from rlblocks.app import train
from rlblocks.critic import CriticTrainer
from rlblocks.data import PromptBatches


def _engine_and_policy(lr: float = 1e-2):
    torch.manual_seed(0)
    policy = tiny_trainer(lr=lr)
    return tiny_engine(policy), policy


@pytest.mark.parametrize(
    "estimator",
    [rb.advantage.grpo, rb.advantage.rloo, rb.advantage.opo, rb.advantage.grpo_passk,
     rb.advantage.reinforce_pp_baseline],
)  # fmt: skip
def test_groups_of_one_are_reported_at_every_call(estimator, caplog):
    rewards, mask = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.ones(4, 3, dtype=torch.bool)
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            advantages, _ = estimator(rewards, mask, torch.tensor([7, 3, 5, 1]))
        assert "every group has one row (4 rows, 4 distinct group ids)" in caplog.text
        assert "(group_size=G with G >= 2, in engine.generate or a recipe)" in caplog.text
        assert not advantages.any()  # the reason: nothing to learn from
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        estimator(rewards, mask, torch.tensor([0, 0, 1, 1]))
    assert caplog.text == ""


def test_square_advantages_passed_transposed_are_refused():
    engine, policy = _engine_and_policy()
    ro = engine.generate(
        ["Count: 1", "Count: 2"], group_size=2, sampling=rb.SamplingParams(max_new_tokens=4)
    )
    ro = ro.replace(
        response_mask=torch.arange(4)[None, :]
        < torch.tensor([4, 2, 3, 1])[:, None]  # not symmetric
    )
    b, t = ro.response_mask.shape
    assert b == t == 4
    advantages, _ = rb.advantage.grpo(
        torch.tensor([1.0, 0.0, 0.5, 0.2]), ro.response_mask, ro.group_ids
    )
    loss = rb.recipes.defaults.PPO_CLIP
    with pytest.raises(ValueError, match="advantages look transposed"):
        policy.step(ro, advantages.T, loss_fn=loss)
    assert policy.step(ro, advantages, loss_fn=loss)["optimizer_steps"] == 1.0  # rows first


def test_a_model_broken_by_its_update_is_named_at_the_next_generate():
    # lr 1e10: the guard passes (finite loss and gradient), the weights reach ~1e10 and the next
    # forward overflows; before, generate died in torch.multinomial ("probability tensor
    # contains either inf, nan or element < 0") without a word about the cause.
    engine, policy = _engine_and_policy(lr=1e10)
    sampling = rb.SamplingParams(max_new_tokens=4)
    ro = engine.generate(["Count: 1"], group_size=4, sampling=sampling)
    metrics = policy.step(
        ro, torch.tensor([1.0, -1.0, 1.0, -1.0]), loss_fn=rb.recipes.defaults.PPO_CLIP
    )
    assert metrics["optimizer_steps"] == 1.0 and metrics["skipped_steps"] == 0.0
    with pytest.raises(FloatingPointError, match="; lower lr, set max_grad_norm"):
        engine.generate(["Count: 1"], group_size=4, sampling=sampling)
    greedy = rb.SamplingParams(max_new_tokens=4, temperature=0.0)  # greedy would go on silently
    with pytest.raises(
        FloatingPointError, match="^HFEngine.generate: the model's next-token scores are not finite"
    ):
        engine.generate(["Count: 1"], group_size=1, sampling=greedy)


# ---------------------------------------------------------------------- refused before step 0
def _recipe_call(name: str, steps: int, run: rb.run.RunOptions):
    """``name`` on the tiny model and the digit task, ``steps`` steps, with ``run``."""
    policy = tiny_trainer(reference="copy")
    engine = tiny_engine(policy)
    reward = rb.rewards.per_sample(digit_fraction, timeout=None)
    batches = PromptBatches(count_prompts(), prompts_per_step=2, seed=0)
    sampling = rb.SamplingParams(max_new_tokens=4)
    if name == "sft":
        examples = digit_examples(policy.tokenizer, 0, 4)
        return rb.recipes.sft(policy, [examples] * 2, steps=steps, run=run)
    if name == "ppo":
        critic = CriticTrainer(policy.model, lr=1e-3)
        return rb.recipes.ppo(policy, critic, engine, reward, batches, steps=steps,
                              group_size=2, sampling=sampling, run=run)  # fmt: skip
    recipe = getattr(rb.recipes, name)
    return recipe(policy, engine, reward, batches, steps=steps, group_size=2, sampling=sampling,
                  run=run)  # fmt: skip


@pytest.mark.parametrize("name", ["grpo", "remax", "dapo", "ppo", "online_dpo", "sft"])
@pytest.mark.parametrize("steps", [0, -3])
def test_non_positive_steps_are_refused_by_every_recipe(name, steps, tmp_path):
    # Before: range(-3) is empty; the recipe returned [] having trained nothing, without a word.
    seen = []
    run = rb.run.RunOptions(
        checkpoint=tmp_path / "run", on_step=lambda *a: seen.append(a), progress=False
    )
    with pytest.raises(ValueError, match=rf": steps={steps} runs no step, so nothing would be "
                       r"trained; pass the number of steps to run, an int >= 1$"):  # fmt: skip
        _recipe_call(name, steps, run)
    assert seen == [] and not (tmp_path / "run").exists()  # refused before anything ran


def test_the_cli_refuses_non_positive_steps_naming_the_file_and_line(tmp_path):
    # Before: `steps: -3` parsed, and rlblocks-train ran no step and exited 0.
    config = tmp_path / "run.yaml"
    config.write_text("recipe: grpo\nmodel:\n  name: tiny\nsteps: -3\n")
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit, match=rf"^{config}, line 4: steps: -3 runs no step"):
        train.main([str(config), "--out", out])
    with pytest.raises(SystemExit, match=r"^command line: steps: 0 runs no step"):
        train.main([str(config), "--steps", "0", "--out", out])
    assert not (tmp_path / "out").exists()


def test_online_dpo_with_one_sample_per_prompt_is_refused(tmp_path):
    # Before: one response per prompt forms no pair; every step trained on nothing (dpo/pairs
    # 0) and the run ended normally.
    seen = []
    run = rb.run.RunOptions(on_step=lambda *a: seen.append(a), progress=False)
    policy = tiny_trainer(reference="auto")
    before = [p.detach().clone() for p in policy.model.parameters()]
    with pytest.raises(ValueError, match=r"^online_dpo: group_size=1 samples one response per "
                       r"prompt, so no pair can form.*pass group_size >= 2"):  # fmt: skip
        rb.recipes.online_dpo(
            policy, tiny_engine(policy), rb.rewards.per_sample(digit_fraction, timeout=None),
            PromptBatches(count_prompts(), prompts_per_step=2, seed=0), steps=2, group_size=1,
            sampling=rb.SamplingParams(max_new_tokens=4), run=run,
        )  # fmt: skip
    assert seen == []
    assert all(torch.equal(a, b) for a, b in zip(before, policy.model.parameters(), strict=True))
    # The CLI passes group_size to the recipe: the same refusal, not an exit with status 0.
    config = tmp_path / "dpo.yaml"
    config.write_text(
        "recipe: online_dpo\nsteps: 2\ngroup_size: 1\nprompts_per_step: 2\nmodel:\n  name: tiny\n"
        "  device: cpu\nsampling:\n  max_new_tokens: 4\ndata:\n  name: arithmetic\n  n: 4\n"
    )
    with pytest.raises(ValueError, match=r"^online_dpo: group_size=1"):
        train.main([str(config), "--out", str(tmp_path / "out")])


def test_duplicate_yaml_keys_are_refused_naming_the_key_and_both_lines(tmp_path):
    # Before: PyYAML kept the last value: this run trained at lr 1e-3 and its saved config.yaml
    # stated 1e-3 as if it had been asked.
    config = tmp_path / "run.yaml"
    config.write_text(
        "recipe: grpo\nsteps: 2\nmodel:\n  name: tiny\ntrainer:\n  lr: 1.0e-5\n"
        "  micro_batch_size: 4\n  lr: 1.0e-3\n"
    )
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=rf"^{config}, line 8: trainer.lr is given twice \(first "
                       r"at line 6\); YAML would keep only the last value, without a word: "
                       r"remove one of them$"):  # fmt: skip
        train.main([str(config), "--out", str(out)])
    assert not out.exists()
    # A file given as --config, and a mapping on the command line, are read the same way.
    twice = tmp_path / "twice.yaml"
    twice.write_text("recipe: grpo\nsteps: 2\nsteps: 3\n")
    with pytest.raises(SystemExit, match=r"steps is given twice \(first at line 2\)"):
        train.parse(["--config", str(twice)])
    with pytest.raises(SystemExit, match=r"(?s)command line: .*max_new_tokens is given twice"):
        train.parse(
            ["--model.name", "tiny", "--sampling", "{max_new_tokens: 3, max_new_tokens: 4}"]
        )


def test_yaml_merge_keys_and_aliases_are_not_duplicates():
    # `<<: *anchor` followed by a key of its own is YAML's way to override on purpose.
    from rlblocks.app import config_yaml  # new here: the rest of the file runs on older code too

    text = "base: &b {lr: 1, clip: 2}\ntrainer:\n  <<: *b\n  lr: 3\nagain: *b\n"
    assert config_yaml.load(text)["trainer"] == {"lr": 3, "clip": 2}
    with pytest.raises(config_yaml.DuplicateKeyError, match=r"^base.clip is given twice"):
        config_yaml.load("base: &b {lr: 1, clip: 2, clip: 3}\n")
    with pytest.raises(config_yaml.DuplicateKeyError, match=r"^runs\[1\].seed is given twice"):
        config_yaml.load("runs:\n- {seed: 1}\n- {seed: 2, seed: 2}\n")


# ---------------------------------------------------------------------- stopped with the reason
def _no_grader(completion: str, **row) -> float:
    raise RuntimeError("grader service unreachable")


ALWAYS_RAISES = rb.rewards.per_sample(_no_grader, timeout=None)
"""A reward whose every row fails: for the CLI's ``reward: test_silent_no_learning:ALWAYS_RAISES``."""


def test_a_reward_failing_on_every_row_stops_the_run_after_five_steps(tmp_path):
    # Before: all 8 steps ran, each row scored the fallback 0, every advantage was 0: the run
    # "succeeded" having learnt nothing, with one warning a step.
    seen = []
    run = rb.run.RunOptions(
        on_step=lambda i, m, r: seen.append(m["reward/failures"]), progress=False,
        checkpoint=tmp_path / "run",
    )  # fmt: skip
    policy = tiny_trainer()
    with pytest.raises(rb.rewards.RewardFailedError, match=r"^RewardFn: _no_grader fell back on "
                       r"every row in 5 reward calls in a row \(the last: reward/failures = 4 of "
                       r"4 rows\).*first: row 0: RuntimeError: grader service unreachable"):  # fmt: skip
        rb.recipes.grpo(
            policy, tiny_engine(policy), rb.rewards.per_sample(_no_grader, timeout=None),
            PromptBatches(count_prompts(), prompts_per_step=2, seed=0), steps=8, group_size=2,
            sampling=rb.SamplingParams(max_new_tokens=4), run=run,
        )  # fmt: skip
    assert seen == [4.0] * 4  # steps 0-3 ran, step 4's reward call stopped the run
    saved = rb.checkpoint.Checkpointer(tmp_path / "run").latest()
    assert saved == 4  # the steps before it are checkpointed, to resume once the reward works


def test_the_cli_stops_too_instead_of_exiting_0(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        "recipe: grpo\nsteps: 7\ngroup_size: 2\nprompts_per_step: 2\nmodel:\n  name: tiny\n"
        "  device: cpu\nsampling:\n  max_new_tokens: 4\ndata:\n  name: arithmetic\n  n: 16\n"
        "reward: test_silent_no_learning:ALWAYS_RAISES\n"
    )
    with pytest.raises(rb.rewards.RewardFailedError, match=r"in 5 reward calls in a row"):
        train.main([str(config), "--out", str(tmp_path / "out")])


def test_steps_must_be_a_count_and_numpy_integers_are_one():
    from rlblocks.run.preflight import check_steps  # new: the file runs on older code too

    check_steps("GRPO", np.int64(3))  # what range() takes is taken
    for wrong in (2.0, "3", True, None):
        with pytest.raises(ValueError, match=rf"^GRPO: steps={wrong!r} is not a count of steps"):
            check_steps("GRPO", wrong)
