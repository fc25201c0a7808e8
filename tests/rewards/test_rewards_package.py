"""The package surface: every registered reward follows the RewardFn contract."""

from __future__ import annotations

import pytest
import torch

import rlblocks.rewards as rewards_pkg
from rlblocks.interfaces import RewardOutput


@pytest.mark.parametrize("name", sorted(rewards_pkg.REWARDS))
def test_registered_rewards_follow_the_contract(make_rollouts, name: str) -> None:
    ro = make_rollouts(
        ["<think>2+2</think><answer>4</answer>", "#### 5", "no answer"],
        [{"ground_truth": "4"}, {"ground_truth": "4"}, {"ground_truth": "4"}],
    )
    out = rewards_pkg.REWARDS[name](ro)
    assert isinstance(out, RewardOutput)
    assert out.rewards.shape == (3,) and out.rewards.dtype == torch.float32
    assert not out.rewards.requires_grad
    assert all(isinstance(v, float) for v in out.metrics.values())
    # Row 0 is correct and well formatted; rows 1 and 2 are neither: both rewards give 1, 0, 0.
    torch.testing.assert_close(out.rewards, torch.tensor([1.0, 0.0, 0.0]))


def test_public_names_exist() -> None:
    for name in rewards_pkg.__all__:
        assert hasattr(rewards_pkg, name), name
