"""`combine`: weighted sums of rewards, metric namespaces, argument checks."""

from __future__ import annotations

import functools

import pytest
import torch

from rlblocks.interfaces import RewardOutput
from rlblocks.rewards.combine import combine
from rlblocks.rewards.guard import per_sample


def first_char_is_a(completion: str, **row: object) -> float:
    return float(completion.startswith("a"))


def length(completion: str, **row: object) -> float:
    return float(len(completion))


accuracy = per_sample(first_char_is_a, timeout=None)  # __name__ "first_char_is_a"
size = per_sample(length, timeout=None)  # __name__ "length"


def test_hand_worked_weights(make_rollouts) -> None:
    ro = make_rollouts(["abc", "b", "a"])
    rewards, metrics = combine({accuracy: 2.0, size: -0.5})(ro)
    # Row 0: 2·1 − 0.5·3 = 0.5; row 1: 2·0 − 0.5·1 = −0.5; row 2: 2·1 − 0.5·1 = 1.5.
    torch.testing.assert_close(rewards, torch.tensor([0.5, -0.5, 1.5]))
    assert rewards.dtype == torch.float32
    assert metrics == {
        "first_char_is_a/mean": pytest.approx(2 / 3),  # (1 + 0 + 1) / 3, before weighting
        "first_char_is_a/failures": 0.0,
        "first_char_is_a/timeouts": 0.0,
        "first_char_is_a/weight": 2.0,
        "length/mean": pytest.approx(5 / 3),  # (3 + 1 + 1) / 3
        "length/failures": 0.0,
        "length/timeouts": 0.0,
        "length/weight": -0.5,
        "reward/mean": pytest.approx(0.5),  # (0.5 − 0.5 + 1.5) / 3
    }


@pytest.mark.parametrize("seed", range(3))
def test_matches_a_loop_over_components(make_rollouts, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    completions = [
        "".join("ab"[int(i)] for i in torch.randint(0, 2, (n,), generator=gen)) for n in range(1, 9)
    ]
    w1, w2 = (float(w) for w in torch.randn(2, generator=gen))
    ro = make_rollouts(completions)
    rewards, _ = combine([(accuracy, w1), (size, w2)])(ro)
    expected = [w1 * first_char_is_a(c) + w2 * length(c) for c in completions]
    torch.testing.assert_close(rewards, torch.tensor(expected))


def test_limits(make_rollouts) -> None:
    ro = make_rollouts(["abc", "b", "a"])
    only, _ = accuracy(ro)
    # One component with weight 1 is the component itself.
    torch.testing.assert_close(combine({accuracy: 1.0})(ro).rewards, only)
    # A weight of 0 removes a component from the total (its metrics are still logged).
    rewards, metrics = combine({accuracy: 1.0, size: 0.0})(ro)
    torch.testing.assert_close(rewards, only)
    assert metrics["length/weight"] == 0.0
    # The dict form and the list form agree.
    torch.testing.assert_close(
        combine({accuracy: 3.0, size: 1.0})(ro).rewards,
        combine([(accuracy, 3.0), ("length", size, 1.0)])(ro).rewards,
    )


def test_names(make_rollouts) -> None:
    ro = make_rollouts(["a"])
    # Explicit names; a partial is named after the function it wraps.
    _, metrics = combine([("acc", accuracy, 1.0), (functools.partial(size), 1.0)])(ro)
    assert {"acc/mean", "acc/weight", "length/mean", "reward/mean"} <= set(metrics)
    with pytest.raises(ValueError, match="share the names"):
        combine([(accuracy, 1.0), (accuracy, 2.0)])
    combine([(accuracy, 1.0), ("accuracy_again", accuracy, 2.0)])  # fixed by naming one


def test_non_reward_metric_keys_are_prefixed(make_rollouts) -> None:
    def custom(rollouts) -> RewardOutput:
        return RewardOutput(torch.ones(rollouts.batch_size), {"hits": 4.0})

    _, metrics = combine({custom: 1.0})(make_rollouts(["a"]))
    assert metrics == {"custom/hits": 4.0, "custom/weight": 1.0, "reward/mean": 1.0}


def test_bad_arguments(make_rollouts) -> None:
    with pytest.raises(ValueError, match="at least one"):
        combine({})
    with pytest.raises(ValueError, match="finite weight"):
        combine({accuracy: float("nan")})
    with pytest.raises(ValueError, match="expected"):
        combine([(accuracy,)])  # type: ignore[list-item]

    def wrong_shape(rollouts) -> RewardOutput:
        return RewardOutput(torch.ones(rollouts.batch_size + 1), {})

    with pytest.raises(ValueError, match="wrong_shape.*shape"):
        combine({wrong_shape: 1.0})(make_rollouts(["a"]))
