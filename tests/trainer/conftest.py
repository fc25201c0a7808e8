"""Shared helpers for the trainer tests: random ragged batches and a slow scoring reference.

Helpers reach the tests as fixtures (``make_rollouts``, ``slow_logprobs``) rather than imports,
so they work under pytest's importlib import mode.
"""

from __future__ import annotations

import pytest
import torch

from rlblocks.models import tiny
from rlblocks.rollouts import Rollouts

VOCAB = 384  # the tiny tokenizer's vocabulary


def ragged_batch(
    b: int = 8, *, seed: int = 0, max_prompt: int = 6, max_response: int = 8
) -> tuple[list[list[int]], list[list[int]], list[list[bool]]]:
    """Prompt and response token lists of random lengths, and response masks.

    Row 0 has a prompt of one token and a response of exactly one valid token; every other row
    has some masked-out "observation" tokens in its response.
    """
    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks = [], [], []
    for i in range(b):
        n_prompt = 1 if i == 0 else int(torch.randint(1, max_prompt + 1, (), generator=g))
        n_response = 1 if i == 0 else int(torch.randint(2, max_response + 1, (), generator=g))
        prompts.append(torch.randint(3, VOCAB, (n_prompt,), generator=g).tolist())
        responses.append(torch.randint(3, VOCAB, (n_response,), generator=g).tolist())
        mask = (torch.rand(n_response, generator=g) > 0.25).tolist()
        mask[0] = True
        masks.append(mask)
    return prompts, responses, masks


def _make_rollouts(b: int = 8, *, seed: int = 0, **kw: int) -> Rollouts:
    prompts, responses, masks = ragged_batch(b, seed=seed, **kw)
    return Rollouts.from_lists(prompts, responses, response_masks=masks, pad_token_id=0)


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
    return _make_rollouts


@pytest.fixture
def slow_logprobs():
    return _slow_logprobs
