"""Shared fixtures of the critic tests: random ragged batches and float64 value models.

Helpers reach the tests as fixtures (``make_rollouts``, ``value_model64``) rather than imports,
so they work under pytest's importlib import mode.
"""

from __future__ import annotations

import pytest
import torch

from rlblocks.critic import ValueModel
from rlblocks.models import tiny
from rlblocks.rollouts import Rollouts

VOCAB = 384  # the tiny tokenizer's vocabulary


def _make_rollouts(b: int = 8, *, seed: int = 0) -> Rollouts:
    """Random prompt / response lengths; row 0: a one-token prompt and one valid response token;
    other rows have masked-out "observation" tokens in their responses."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks = [], [], []
    for i in range(b):
        n_prompt = 1 if i == 0 else int(torch.randint(1, 7, (), generator=g))
        n_response = 1 if i == 0 else int(torch.randint(2, 9, (), generator=g))
        prompts.append(torch.randint(3, VOCAB, (n_prompt,), generator=g).tolist())
        responses.append(torch.randint(3, VOCAB, (n_response,), generator=g).tolist())
        mask = (torch.rand(n_response, generator=g) > 0.25).tolist()
        mask[0] = True
        masks.append(mask)
    return Rollouts.from_lists(prompts, responses, response_masks=masks, pad_token_id=0)


def _value_model64(init_std: float = 0.1) -> ValueModel:
    """A float64 tiny backbone with a random (not zero) head, so every weight gets a gradient."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return ValueModel(tiny(dtype=torch.float64)[0], init_std=init_std)


@pytest.fixture
def make_rollouts():
    return _make_rollouts


@pytest.fixture
def value_model64():
    return _value_model64
