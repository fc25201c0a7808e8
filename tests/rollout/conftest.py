"""Fixtures for the rollout engine tests: tiny random models, a forward-pass log-prob reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from engine_cases import with_eos_bias
from torch import Tensor, nn

from rlblocks.models import tiny
from rlblocks.rollouts import Rollouts


@pytest.fixture(scope="module")
def peaky():
    """A tiny model with larger initial weights (std 0.3 instead of 0.02): its next-token
    distributions are peaked (mean log-prob ≈ −1.5 instead of ≈ −ln 384), so greedy decoding
    does not repeat one token forever and padding mistakes change the continuation."""
    return tiny(initializer_range=0.3)


def _eos_biased(bias: float = 4.0):
    """The default tiny model with a bias on the EOS logit, so EOS is sampled often.

    The embeddings are untied and the head becomes an ``nn.Linear`` with a bias: with bias 4 the
    EOS logit beats each of the ~383 near-equal others by e⁴ ≈ 55, p(EOS) ≈ 55 / (383 + 55) ≈ 0.13
    per step at T = 1, so in 10 steps some rows end and some do not.
    """
    model, tokenizer = tiny(tie_word_embeddings=False)
    return with_eos_bias(model, tokenizer, bias), tokenizer


@pytest.fixture
def eos_biased() -> Callable:
    return _eos_biased


def _forward_logprobs(model: nn.Module, ro: Rollouts, temperature: float) -> Tensor:
    """log softmax(logits / T) at the response tokens, from ONE uncached forward pass over
    prompt + response: attention mask from the batch, position ids counting real tokens only
    (so a left-padded row has the positions it would have alone). (b t) float32, 0 off-mask."""
    mask = ro.attention_mask.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ro.input_ids, attention_mask=mask, position_ids=positions).logits
    tp = ro.prompt_ids.shape[1]
    scores = logits[:, tp - 1 : -1].float() / temperature  # position j predicts token j + 1
    logprobs = torch.log_softmax(scores, -1).gather(-1, ro.response_ids[..., None])[..., 0]
    return torch.where(ro.response_mask, logprobs, 0.0)


@pytest.fixture
def forward_logprobs() -> Callable:
    return _forward_logprobs
