"""Shared helpers for the trainer tests: random ragged batches and a slow scoring reference.

Helpers reach the tests as fixtures (``make_rollouts``, ``slow_logprobs``); ``make_rollouts``
is `builders.ragged_rollouts`, the batch every test folder shares.
"""

from __future__ import annotations

import pytest
import torch
from builders import ragged_rollouts

from rlblocks.models import tiny
from rlblocks.rollouts import Rollouts


@torch.no_grad()
def _slow_logprobs(model, rollouts: Rollouts, *, temperature: float = 1.0) -> torch.Tensor:
    """Each row alone, unpadded, full-vocabulary log_softmax: obviously correct, slow."""
    b, t = rollouts.response_ids.shape
    out = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        prompt = rollouts.prompt_ids[i][rollouts.prompt_mask[i]]
        response = rollouts.response_ids[i][rollouts.response_attention_mask[i]]
        logits = model(torch.cat([prompt, response])[None]).logits[0].double() / temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        for k in range(len(response)):  # token k is predicted at position len(prompt) + k - 1
            out[i, k] = logprobs[len(prompt) + k - 1, response[k]]
    return out


@pytest.fixture
def model64():
    return tiny(dtype=torch.float64)[0]


@pytest.fixture
def model32():
    return tiny()[0]


@pytest.fixture
def make_rollouts():
    return ragged_rollouts


@pytest.fixture
def slow_logprobs():
    return _slow_logprobs
