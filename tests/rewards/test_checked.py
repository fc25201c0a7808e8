"""Where rewards enter a loop: the RewardFn contract, and NaN/inf rows that cost nothing else."""

from __future__ import annotations

import logging

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import run_group_recipe

import rlblocks as rb
from rlblocks.rewards import checked


def _rollouts(n: int = 4) -> rb.Rollouts:
    model, tokenizer = rb.models.tiny(seed=0)
    engine = rb.rollout.HFEngine(model, tokenizer, progress=False)
    torch.manual_seed(0)
    return engine.generate(
        ["a", "b"], group_size=n // 2, sampling=rb.SamplingParams(max_new_tokens=3)
    )


def nan_for_row_one(rollouts):
    rewards = torch.ones(len(rollouts))
    rewards[1] = float("nan")
    return rb.RewardOutput(rewards, {"reward/mean": float(rewards.mean())})


def test_a_nan_row_gets_the_fallback_is_counted_and_named_every_time(caplog):
    ro, reward = _rollouts(), checked(nan_for_row_one, fallback=-1.0)
    for _ in range(2):  # every call, not once per process
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            rewards, metrics = reward(ro)
        assert "nan_for_row_one returned 1 non-finite score(s) (rows 1" in caplog.text
    assert rewards.tolist() == [1.0, -1.0, 1.0, 1.0]
    assert metrics["reward/nonfinite"] == 1.0 and metrics["reward/mean"] == 0.5  # recomputed
    assert checked(lambda r: (torch.ones(4), {}))(ro).metrics["reward/nonfinite"] == 0.0


@pytest.mark.parametrize(
    ("returned", "error", "says"),
    [
        (torch.ones(4), TypeError, "returned a Tensor of shape (4,)"),
        ([1.0, 2.0, 3.0, 4.0], TypeError, "returned a list"),
        ((torch.ones(3), {}), ValueError, "shape (3,) for 4 rows"),
        ((torch.ones(4, 1), {}), ValueError, "shape (4, 1) for 4 rows"),
        ((torch.ones(4), [0.5]), TypeError, "metrics of type list"),
        ((["a", "b", "c", "d"], {}), TypeError, "returned rewards that are not numbers"),
    ],
)
def test_a_wrong_output_states_the_contract(returned, error, says):
    def bad_reward(rollouts):
        return returned

    with pytest.raises(
        error, match=r"^RewardFn: \S*bad_reward returned .*RewardFn returns RewardOutput"
    ) as info:
        checked(bad_reward)(_rollouts())
    assert says in str(info.value) and "bad_reward" in str(info.value)


def test_a_list_of_numbers_with_metrics_is_accepted():
    rewards, _ = checked(lambda r: ([0, 1, 2, 3], {}))(_rollouts())
    assert rewards.dtype == torch.float32 and rewards.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_one_nan_row_no_longer_costs_the_grpo_step():
    # Before: the NaN made its group's advantages NaN and the NaN guard skipped every update.
    policy = tiny_trainer(reference="auto")
    engine = tiny_engine(policy)

    def digits_but_row_0_nan(rollouts):
        scores = [sum(c.isdigit() for c in t) / max(len(t), 1) for t in rollouts.completions]
        scores[0] = float("nan")
        return rb.RewardOutput(torch.tensor(scores), {})

    torch.manual_seed(0)
    history = run_group_recipe(
        rb.recipes.grpo, policy, engine, steps=2, reward=digits_but_row_0_nan
    )
    assert [h["optimizer_steps"] for h in history] == [1.0, 1.0]  # an update each step
    assert [h["skipped_steps"] for h in history] == [0.0, 0.0]
    assert [h["reward/nonfinite"] for h in history] == [1.0, 1.0]


# ---------------------------------------------------------------------- every row failing, call after call
def always_raises(completion: str, **row) -> float:
    raise ValueError(f"no grader for {completion[:3]!r}")


def digits(completion: str, **row) -> float:
    return float(sum(c.isdigit() for c in completion))


def test_every_row_failing_five_calls_in_a_row_stops_with_the_reason():
    # Before: every call scored the fallback on every row, forever, with a warning each time.
    ro = _rollouts()
    reward = checked(rb.rewards.per_sample(always_raises, timeout=None))
    for _ in range(4):  # calls 1-4: the fallback, as one odd failure would get
        rewards, metrics = reward(ro)
        assert rewards.tolist() == [0.0] * 4 and metrics["reward/failures"] == 4.0
    with pytest.raises(rb.rewards.RewardFailedError, match=r"^RewardFn: always_raises fell back on every "
                       r"row in 5 reward calls in a row \(the last: reward/failures = 4 of 4 "
                       r"rows\), so every advantage was 0 and those steps trained on nothing; the "
                       r"last failure: reward 'always_raises': 4 of 4 rows failed \(0 timed out\) "
                       r"and scored 0; first: row 0: ValueError: no grader for .*max_failed_calls"
                       r"=None\) as the recipe's reward"):  # fmt: skip
        reward(ro)


def test_one_scored_row_ends_the_streak_and_the_limit_is_the_users():
    ro = _rollouts()
    calls = iter(range(100))

    def alternating(rollouts):  # every row fails, then none does, then every row, ...
        fn = always_raises if next(calls) % 2 == 0 else digits
        return rb.rewards.per_sample(fn, timeout=None)(rollouts)

    reward = checked(alternating)
    for _ in range(12):
        reward(ro)  # never 5 all-failed calls in a row: never stops
    assert reward.failed_calls == 0  # the 12th call scored
    never = checked(rb.rewards.per_sample(always_raises, timeout=None), max_failed_calls=None)
    for _ in range(8):
        never(ro)
    assert never.failed_calls == 8
    two = checked(rb.rewards.per_sample(always_raises, timeout=None), max_failed_calls=2)
    assert checked(two) is two  # what a recipe does with it: used as it is
    two(ro)
    with pytest.raises(rb.rewards.RewardFailedError, match=r"in 2 reward calls in a row"):
        two(ro)
    with pytest.raises(ValueError, match=r"^checked: max_failed_calls must be >= 1 or None, got 0"):
        checked(digits_reward, max_failed_calls=0)


def digits_reward(rollouts):
    return rb.rewards.per_sample(digits, timeout=None)(rollouts)


def test_a_combined_component_failing_on_every_row_is_named():
    # The task reward scores; the format component's grader is broken for every row.
    ro = _rollouts()
    broken = rb.rewards.per_sample(always_raises, timeout=None, name="format")
    reward = checked(rb.rewards.combine({digits_reward: 1.0, broken: 0.5}), max_failed_calls=3)
    reward(ro)
    reward(ro)
    with pytest.raises(rb.rewards.RewardFailedError, match=r"\(the last: format/failures = 4 of 4 rows\).*"
                       r"reward 'format': 4 of 4 rows failed"):  # fmt: skip
        reward(ro)
    # Every score NaN is every row falling back too (checked gives them the fallback).
    nan = checked(lambda r: (torch.full((len(r),), float("nan")), {}), max_failed_calls=1)
    with pytest.raises(
        rb.rewards.RewardFailedError, match=r"the last: reward/nonfinite = 4 of 4 rows"
    ):
        nan(ro)
