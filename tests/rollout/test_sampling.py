"""sampled_logprobs, generation_config and seeded: hand-worked values, a loop reference, limits."""

from __future__ import annotations

import math

import pytest
import torch

from rlblocks.interfaces import SamplingParams
from rlblocks.rollout.sampling import generation_config, sampled_logprobs, seeded


# ---------------------------------------------------------------------- sampled_logprobs
def test_sampled_logprobs_by_hand():
    # One row, two steps, vocabulary of 2.
    # step 0: z = [0, ln 3], y = 1, T = 1: softmax = [1/4, 3/4] -> ln(3/4) = -0.287682
    # step 1: z = [ln 2, 0], y = 0, T = 1: softmax = [2/3, 1/3] -> ln(2/3) = -0.405465
    logits = [torch.tensor([[0.0, math.log(3)]]), torch.tensor([[math.log(2), 0.0]])]
    out = sampled_logprobs(logits, torch.tensor([[1, 0]]), temperature=1.0)
    torch.testing.assert_close(out, torch.tensor([[math.log(3 / 4), math.log(2 / 3)]]))
    # T = 0.5 doubles the logits: step 0 z/T = [0, 2 ln 3] -> softmax = [1/10, 9/10] -> ln(0.9)
    logits = [torch.tensor([[0.0, math.log(3)]])]
    out = sampled_logprobs(logits, torch.tensor([[1]]), temperature=0.5)
    torch.testing.assert_close(out, torch.tensor([[math.log(0.9)]]))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_sampled_logprobs_match_a_loop(seed, temperature):
    gen = torch.Generator().manual_seed(seed)
    b, t, v = 4, 5, 11
    logits = torch.randn(b, t, v, generator=gen) * 3
    tokens = torch.randint(v, (b, t), generator=gen)
    out = sampled_logprobs(list(logits.unbind(1)), tokens, temperature=temperature)
    expected = torch.zeros(b, t)
    for i in range(b):  # slow reference, one entry at a time
        for k in range(t):
            expected[i, k] = torch.log_softmax(logits[i, k] / temperature, -1)[tokens[i, k]]
    torch.testing.assert_close(out, expected)
    assert out.dtype == torch.float32


def test_sampled_logprobs_limits():
    # Uniform logits: every token has log-prob -ln v, at any temperature.
    logits = [torch.full((3, 7), 2.5), torch.zeros(3, 7)]
    out = sampled_logprobs(logits, torch.zeros(3, 2, dtype=torch.long), temperature=0.3)
    torch.testing.assert_close(out, torch.full((3, 2), -math.log(7)))
    # bfloat16 logits are computed in float32.
    bf16 = [torch.tensor([[0.0, 1.0]], dtype=torch.bfloat16)]
    out = sampled_logprobs(bf16, torch.tensor([[1]]), temperature=1.0)
    torch.testing.assert_close(out, torch.tensor([[-math.log1p(math.exp(-1.0))]]))
    with pytest.raises(ValueError, match="^sampled_logprobs: 2 logit steps for 3 sampled tokens; "):
        sampled_logprobs(logits, torch.zeros(3, 3, dtype=torch.long), temperature=1.0)


# ---------------------------------------------------------------------- generation_config
def test_generation_config_maps_sampling_params():
    params = SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=0, seed=1)
    config = generation_config(params, pad_token_id=0, eos_token_ids=[2, 5])
    assert (config.max_new_tokens, config.do_sample, config.temperature) == (9, True, 0.7)
    assert (config.top_p, config.top_k, config.num_beams) == (0.9, 0, 1)  # top_k 0 = off
    assert config.eos_token_id == [2, 5] and config.pad_token_id == 0
    assert config.output_logits and config.return_dict_in_generate and config.use_cache
    assert config.min_new_tokens == 0  # EOS allowed from the first token
    fixed = SamplingParams(max_new_tokens=9, min_new_tokens=9)
    assert generation_config(fixed, pad_token_id=0, eos_token_ids=[2]).min_new_tokens == 9
    greedy = generation_config(SamplingParams(temperature=0), pad_token_id=0, eos_token_ids=[])
    assert greedy.do_sample is False and greedy.eos_token_id is None


# ---------------------------------------------------------------------- seeded
def test_seeded_is_reproducible_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    with seeded(3, torch.device("cpu")):
        a = torch.rand(4)
    with seeded(3, torch.device("cpu")):
        b = torch.rand(4)
    assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), state)
    with seeded(None, torch.device("cpu")):  # no seed: the global generator, which advances
        torch.rand(1)
    assert not torch.equal(torch.get_rng_state(), state)
