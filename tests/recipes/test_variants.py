"""GRPO-family variants as compositions: each must raise the toy reward on the tiny model.

RLOO, REINFORCE++-baseline and Dr.GRPO are `rb.recipes.grpo` with another ``advantage=`` (and,
for Dr.GRPO, another trainer aggregation); ReMax is `rb.recipes.remax`, the GRPO loop plus a
greedy baseline. The toy task is tests/recipes/test_grpo.py's digit fraction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import run_group_recipe
from weightless import Weightless

import rlblocks as rb
from rlblocks.interfaces import RewardOutput, Rollouts, SamplingParams
from rlblocks.recipes.variants import greedy_baseline_rewards, remax, with_greedy_answers


def tiny_run(recipe, *, lr: float = 1e-2, steps: int, aggregation=rb.losses.token_mean, **kw):
    """``recipe`` on the tiny model and the digit-fraction task; the reward of every step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = tiny_trainer(lr=lr, aggregation=aggregation)
        engine = tiny_engine(policy)
        history = run_group_recipe(recipe, policy, engine, steps=steps, **kw)
    return [h["reward/mean"] for h in history]


# Each variant is a few words away from GRPO. 20 steps: measured, all three reach ~1.0 by
# step 16 from ~0.02 at the start.
VARIANTS = {
    "rloo": {"advantage": rb.advantage.rloo},
    "reinforce_pp_baseline": {"advantage": rb.advantage.reinforce_pp_baseline},
    "dr_grpo": {
        "advantage": partial(rb.advantage.grpo, scale_by_std=False),
        "aggregation": rb.losses.SeqMeanTokenSumNorm(max_tokens=8),  # C = generation budget
    },
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_grpo_variant_raises_the_reward(name):
    rewards = tiny_run(rb.recipes.grpo, steps=20, **VARIANTS[name])
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.1, rewards
    assert last > 0.8, rewards


def test_remax_raises_the_reward():
    # 40 steps, not 30: the random model's *greedy* answer is already all digits (baseline
    # 1.0 at step 0), so early on every sample gets A = r − 1 ≤ 0 and the signal is only
    # "less of this". Measured: ~0.03 until step 17, ~0.77 at step 29, ~1.0 from step 32.
    rewards = tiny_run(remax, steps=40)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.1, rewards
    assert last > 0.8, rewards


def test_remax_with_zero_learning_rate_does_not_learn():
    rewards = tiny_run(remax, lr=0.0, steps=10)
    assert sum(rewards[-3:]) / 3 < 0.1, rewards


# ---------------------------------------------------------------------- ReMax's baseline
class Batch(NamedTuple):
    prompts: list[str]
    metadata: list[dict[str, Any]]


class ScriptedEngine(Weightless):
    """A deterministic `RolloutEngine`. Sample k of prompt "a b" is word k mod 2; the greedy
    answer (temperature 0) is the last word. Rows come back in *reverse* order, which the
    protocol allows, with group ids 10·(prompt index)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, SamplingParams]] = []

    def generate(
        self,
        prompts: Sequence[str],
        *,
        group_size: int = 1,
        sampling: SamplingParams | None = None,
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rollouts:
        self.calls.append((group_size, sampling))
        greedy = sampling is not None and sampling.temperature == 0
        rows = [
            (i, p, p.split()[-1] if greedy else p.split()[k % len(p.split())])
            for i, p in enumerate(prompts)
            for k in range(group_size)
        ][::-1]
        return Rollouts.from_lists(
            [[1, 2]] * len(rows),
            [[5] * len(c) for _, _, c in rows],
            group_ids=[10 * i for i, _, _ in rows],
            prompts=[p for _, p, _ in rows],
            completions=[c for _, _, c in rows],
            metadata=[dict(metadata[i]) if metadata else {} for i, _, _ in rows],
        )


def accuracy(rollouts: Rollouts, /) -> RewardOutput:
    """1.0 when the completion is only "1"s, else 0.0."""
    r = torch.tensor([float(set(c) == {"1"}) for c in rollouts.completions])
    return RewardOutput(r, {"reward/mean": float(r.mean())})


class RecordingTrainer:
    """A `PolicyTrainer` that records what it is asked to train on and changes nothing."""

    model = torch.nn.Linear(1, 1)  # nothing the engine shares
    config = None
    has_adapter = False
    tokenizer = None

    def __init__(self) -> None:
        self.seen: list[tuple[Rollouts, torch.Tensor]] = []

    def step(self, rollouts, advantages, *, loss_fn, old_logprobs=None, minibatches=None):
        self.seen.append((rollouts, advantages))
        return {"loss": 0.0}

    def logprobs(self, rollouts):
        return torch.zeros(rollouts.response_ids.shape)

    def ref_logprobs(self, rollouts):
        return torch.zeros(rollouts.response_ids.shape)

    def named_weights(self, *, bucket_bytes=None):
        return iter(())

    def weight_spec(self):
        return {}

    def save_adapter(self, folder):
        raise ValueError("no adapter")

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_greedy_baseline_gives_each_row_its_prompts_greedy_reward():
    engine = ScriptedEngine()
    batch = Batch(["1 0", "0 1", "1 0"], [{}, {}, {}])
    sampling = SamplingParams(max_new_tokens=5, temperature=0.9, top_p=0.8)
    # ReMax's rows: the samples, then one greedy answer per prompt by the same engine.
    drawn = with_greedy_answers(engine, batch, group_size=2, sampling=sampling)
    rollouts, greedy = drawn.select(~drawn.extras["greedy"]), drawn.select(drawn.extras["greedy"])
    baseline, metrics = greedy_baseline_rewards(accuracy, rollouts, greedy)
    # Greedy answers: "1 0" -> "0" (reward 0), "0 1" -> "1" (reward 1). The rows come back
    # reversed: prompts "1 0", "1 0", "0 1", "0 1", "1 0", "1 0" -> baselines 0, 0, 1, 1, 0, 0.
    assert rollouts.prompts == ["1 0", "1 0", "0 1", "0 1", "1 0", "1 0"]
    torch.testing.assert_close(baseline, torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 0.0]))
    assert list(metrics) == ["baseline/mean"]  # the reward's "reward/mean", renamed
    torch.testing.assert_close(metrics["baseline/mean"], 1 / 3)  # one greedy answer of 3 right
    # One greedy answer per prompt, at temperature 0, the other settings kept.
    assert engine.calls[-1] == (1, SamplingParams(max_new_tokens=5, temperature=0.0, top_p=0.8))


def test_greedy_baseline_needs_every_prompt():
    engine = ScriptedEngine()
    rollouts = engine.generate(["1 0", "0 1"], group_size=1)
    greedy = engine.generate(["0 1"], group_size=1, sampling=SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="no greedy answer for the prompt '1 0'"):
        greedy_baseline_rewards(accuracy, rollouts, greedy)


def test_remax_recipe_trains_on_reward_minus_greedy_reward():
    trainer, seen = RecordingTrainer(), []
    history = remax(
        trainer,
        ScriptedEngine(),
        accuracy,
        iter([Batch(["1 0", "0 1"], [{}, {}])]),
        steps=3,
        group_size=3,
        sampling=SamplingParams(max_new_tokens=4),
        run=rb.run.RunOptions(on_step=lambda step, m, ro: seen.append(ro), progress=False),
    )
    assert len(history) == 1  # one batch: one step
    rollouts, advantages = trainer.seen[0]
    # Reversed rows: "0 1" samples "0", "1", "0" (rewards 0, 1, 0) come first, in reverse
    # (k = 2, 1, 0): "0", "1", "0"; greedy "1" -> baseline 1 -> A = -1, 0, -1. Then "1 0"
    # samples "1", "0", "1" -> rewards 1, 0, 1; greedy "0" -> baseline 0 -> A = 1, 0, 1.
    assert rollouts.completions == ["0", "1", "0", "1", "0", "1"]
    # One token per response: A broadcast over it.
    torch.testing.assert_close(
        advantages, torch.tensor([[-1.0], [0.0], [-1.0], [1.0], [0.0], [1.0]])
    )
    assert history[0]["reward/mean"] == 0.5 and history[0]["baseline/mean"] == 0.5
    assert seen == [rollouts]
