"""Shared fixtures of the critic tests: random ragged batches and float64 value models.

Helpers reach the tests as fixtures (``make_rollouts``, ``value_model64``); ``make_rollouts`` is
`builders.ragged_rollouts`, the batch every test folder shares.
"""

from __future__ import annotations

import pytest
import torch
from builders import ragged_rollouts

from rlblocks.critic import ValueModel
from rlblocks.models import tiny


def _value_model64(init_std: float = 0.1) -> ValueModel:
    """A float64 tiny backbone with a random (not zero) head, so every weight gets a gradient."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return ValueModel(tiny(dtype=torch.float64)[0], init_std=init_std)


@pytest.fixture
def make_rollouts():
    return ragged_rollouts


@pytest.fixture
def value_model64():
    return _value_model64
