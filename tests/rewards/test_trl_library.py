"""from_trl against TRL itself: TRL's own reward functions (``trl.rewards``) score rows as TRL
would have them score, and a reward that reads ``trainer_state`` sees the run's step and epoch.

tests/rewards/test_interop.py checks what from_trl passes with functions written as TRL's docs
write them; here TRL is imported (the ``bench`` extra, in ``dev``), so a change in TRL's own
functions or in what they read shows here.
"""

from __future__ import annotations

import pytest
import torch
import trl.rewards
from builders import tiny_engine, tiny_trainer
from transformers import TrainerState

import rlblocks as rb
from rlblocks.data import PromptBatches
from rlblocks.rewards import from_trl
from rlblocks.rollouts import Rollouts

CHAT = [{"role": "user", "content": "What is 1/3 + 0?"}]


def rows(completions: list[str], lengths: list[int], solutions: list[str]) -> Rollouts:
    """A batch of chat rows (``prompt`` as messages, ``solution`` as TRL's math datasets have
    it) whose responses have ``lengths`` real tokens."""
    return Rollouts.from_lists(
        prompt_ids=[[5, 6]] * len(completions),
        response_ids=[list(range(7, 7 + n)) for n in lengths],
        completions=completions,
        metadata=[{"prompt": CHAT, "solution": s} for s in solutions],
    )


def test_trl_think_format_reward():
    # 1.0 when the completion opens with a <think>…</think> block, else 0.0 (TRL's docstring).
    ro = rows(
        ["<think>\nadd\n</think>\n1/3", "no tags: 1/3", "<think>a</think>b"], [3, 3, 3], ["x"] * 3
    )
    out = from_trl(trl.rewards.think_format_reward)(ro)
    assert out.rewards.tolist() == [1.0, 0.0, 1.0]


def test_trl_accuracy_reward_with_math_verify():
    # math-verify parses both sides: \frac{1}{3} is right, 1/2 is wrong; an unparseable
    # solution gives None (TRL skips the row), which from_trl scores none_score and counts.
    ro = rows(
        [r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", r"\boxed{1}"],
        [3, 3, 3],
        [r"$\frac{1}{3}$", r"$\frac{1}{3}$", "not a formula @@"],
    )
    out = from_trl(trl.rewards.accuracy_reward, none_score=-7.0)(ro)
    assert out.rewards.tolist() == [1.0, 0.0, -7.0]
    assert out.metrics["reward/none"] == 1.0


def test_trl_soft_overlong_punishment_reads_completion_ids():
    # DAPO's soft overlong punishment on the real response tokens: L_max = 10, cache 4, so
    # lengths <= 6 get 0, 8 gets (6 - 8) / 4 = -0.5, > 10 gets -1.
    punish = trl.rewards.get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    ro = rows(["a", "b", "c"], [5, 8, 12], ["x"] * 3)
    assert from_trl(punish)(ro).rewards.tolist() == [0.0, -0.5, -1.0]


def test_trl_repetition_penalty_reads_completion_ids():
    # 3-grams of [7..11] are all distinct: 0. [7, 7, 7, 7, 7] has 3 trigrams, 1 distinct:
    # penalty = (1 - 1/3) * max_penalty = -2/3 (TRL's formula, scaling 1 - unique / total).
    penalty = trl.rewards.get_repetition_penalty_reward(ngram_size=3, max_penalty=-1.0)
    ro = Rollouts.from_lists(
        prompt_ids=[[5], [5]], response_ids=[[7, 8, 9, 10, 11], [7, 7, 7, 7, 7]],
        completions=["a", "b"], metadata=[{}, {}],
    )  # fmt: skip
    torch.testing.assert_close(from_trl(penalty)(ro).rewards, torch.tensor([0.0, -2 / 3]))


def test_trainer_state_carries_the_runs_step_and_epoch():
    # TRL passes its TrainerState; a reward that schedules on it (a curriculum, a warm-up)
    # reads global_step, max_steps and epoch. 3 steps of 2 prompts over 4 distinct prompts:
    # before each step 0, 1, 2 updates and 0, 2/4, 4/4 epochs of the data drawn.
    seen: list[TrainerState] = []

    def scheduled(completions, trainer_state, **kwargs):
        seen.append(trainer_state)
        return [float(trainer_state.global_step)] * len(completions)

    data = rb.data.arithmetic_prompts(4, chat=True)
    policy = tiny_trainer(lr=1e-3)
    history = rb.recipes.grpo(
        policy, tiny_engine(policy), from_trl(scheduled),
        PromptBatches(data, prompts_per_step=2, seed=0), steps=3, group_size=2,
        sampling=rb.SamplingParams(max_new_tokens=4, seed=0),
        run=rb.run.RunOptions(progress=False),
    )  # fmt: skip
    assert all(isinstance(s, TrainerState) for s in seen)
    assert [(s.global_step, s.max_steps, s.epoch) for s in seen] == [
        (0, 3, 0.0), (1, 3, 0.5), (2, 3, 1.0),
    ]  # fmt: skip
    assert [h["reward/mean"] for h in history] == [0.0, 1.0, 2.0]
    # Outside a run (a reward called by hand) it is TrainerState() at step 0.
    from_trl(scheduled)(rows(["a"], [2], ["x"]))
    assert seen[-1].global_step == 0 and seen[-1].epoch == 0


@pytest.mark.parametrize("name", ["think_format_reward", "accuracy_reward"])
def test_trl_rewards_take_what_from_trl_passes(name):
    # Built without a TypeError: their signatures take TRL's keywords (from_trl checks them).
    assert callable(from_trl(getattr(trl.rewards, name)))
