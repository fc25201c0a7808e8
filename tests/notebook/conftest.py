"""Fixtures for the dashboard tests: a small batch with HTML-like text, a controllable clock."""

from __future__ import annotations

import pytest

from rlblocks.rollouts import Rollouts


class FakeClock:
    """Returns the times in ``ticks`` one after another: each ``Dashboard`` reading is scripted."""

    def __init__(self, *ticks: float) -> None:
        self.ticks = list(ticks)

    def __call__(self) -> float:
        return self.ticks.pop(0)


@pytest.fixture
def clock():
    return FakeClock


@pytest.fixture
def batch() -> Rollouts:
    """Four rows in two groups with non-contiguous ids 7, 7, 3, 3; completions with markup."""
    return Rollouts.from_lists(
        [[1, 2], [1, 2], [3], [3]],
        [[4, 5], [6], [7, 8, 9], [10]],
        group_ids=[7, 7, 3, 3],
        prompts=["What is 1+1?", "What is 1+1?", "Is 2 < 3?", "Is 2 < 3?"],
        completions=["<think>easy</think> 2", "3", "yes & <b>sure</b>", "no"],
    )
