"""Gradient accumulation must not change the gradient: 1×8 = 8×1 = 2×4 micro-batches.

A tiny Qwen2 causal LM (built from a config, seeded, no download) scores the response tokens
of a mini-batch of 8 sequences with varying response lengths; the per-token loss is the PPO
clipped surrogate plus a k3 KL term and an entropy bonus, aggregated with every mode. Summing
the micro-batch losses, each divided by the *mini-batch* normalizer, must give the gradient of
one pass over the mini-batch; normalizing each micro-batch by its own token count must not.

The model runs in float64. A forward pass over 8 rows and over 1 row may take different matmul
blocking, so the logits agree only up to rounding; in float32 that noise (~1e-7 relative per
op, then summed over micro-batches in a different order) sits right at the default float32
tolerance (rtol 1.3e-6) and would make the test flaky or force a looser tolerance. In float64
the noise is ~1e-16, so the default float64 tolerance (rtol 1e-7) is safe and still far
tighter than the effect the negative control shows (relative differences of order 1e-1).
"""

import pytest
import torch
from torch.testing import assert_close
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlblocks.losses import (
    aggregate,
    clipped_surrogate,
    entropy_from_logits,
    entropy_loss,
    k3,
    kl_loss,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_logprobs,
    token_mean,
)

MODES = [token_mean, seq_mean_token_sum, seq_mean_token_mean, seq_mean_token_sum_norm]
B, PROMPT, RESPONSE, VOCAB = 8, 4, 10, 64


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return Qwen2ForCausalLM(config).double().eval()  # eval: no dropout, a deterministic loss


@pytest.fixture(scope="module")
def batch(model):
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (B, PROMPT + RESPONSE), generator=g)
    # response lengths 10, 1, 7, 3, 1, 10, 5, 8: two rows with a single valid token
    lengths = torch.tensor([10, 1, 7, 3, 1, 10, 5, 8])
    mask = torch.arange(RESPONSE)[None, :] < lengths[:, None]
    mask[0, 4:6] = False  # tool-observation tokens inside a response
    with torch.no_grad():
        logprobs = _response_logprobs(model, input_ids)[0]
    # the rollout policy differs from the current one, so that some ratios leave the clip range
    old_logprobs = logprobs + 0.3 * torch.randn(logprobs.shape, generator=g, dtype=torch.float64)
    ref_logprobs = logprobs + 0.5 * torch.randn(logprobs.shape, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)[:, None].expand(B, RESPONSE)
    return input_ids, mask, old_logprobs, ref_logprobs, advantages


def _response_logprobs(model, input_ids):
    logits = model(input_ids).logits[:, PROMPT - 1 : -1]  # position t scores token t + 1
    response_ids = input_ids[:, PROMPT:]
    return token_logprobs(logits, response_ids, chunk_size=7), logits


def _per_token_loss(model, batch, rows):
    input_ids, mask, old_logprobs, ref_logprobs, advantages = (x[rows] for x in batch)
    logprobs, logits = _response_logprobs(model, input_ids)
    pg, metrics = clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip=(0.2, 0.28))
    kl, _ = kl_loss(logprobs, ref_logprobs, mask, estimator=k3)
    ent, _ = entropy_loss(entropy_from_logits(logits, chunk_size=7), mask)
    return pg + 0.05 * kl + 0.01 * ent, mask, metrics


def _accumulated_grads(model, batch, micro_batches, mode, *, naive=False):
    """Backward each micro-batch's aggregated loss; return the accumulated parameter grads."""
    model.zero_grad(set_to_none=True)
    normalizer = mode.normalizer(batch[1])  # once, over the whole mini-batch
    clip_fracs = []
    for rows in micro_batches:
        loss, mask, metrics = _per_token_loss(model, batch, rows)
        if naive:  # the classic bug: own normalizer per micro-batch, then an average
            scalar = aggregate(loss, mask, mode=mode) / len(micro_batches)
        else:
            scalar = aggregate(loss, mask, mode=mode, normalizer=normalizer)
        scalar.backward()
        clip_fracs.append(metrics["clip_frac"])
    return {n: p.grad.clone() for n, p in model.named_parameters()}, clip_fracs


SPLITS = {
    "1x8": [torch.arange(8)],
    "8x1": [torch.tensor([i]) for i in range(8)],
    "2x4": [torch.arange(0, 4), torch.arange(4, 8)],
    "2x4-shuffled": [torch.tensor([6, 1, 3, 0]), torch.tensor([2, 7, 5, 4])],
}


@pytest.mark.parametrize("mode", MODES, ids=type)
@pytest.mark.parametrize("split", ["8x1", "2x4", "2x4-shuffled"])
def test_micro_batches_give_the_mini_batch_gradient(model, batch, mode, split):
    full, clip_fracs = _accumulated_grads(model, batch, SPLITS["1x8"], mode)
    assert clip_fracs[0] > 0  # the clip is exercised, not only the ratio-1 path
    assert all(g.abs().sum() > 0 for g in full.values())
    accumulated, _ = _accumulated_grads(model, batch, SPLITS[split], mode)
    assert_close(accumulated, full)


def test_naive_micro_batch_normalization_changes_the_gradient(model, batch):
    # Negative control: the micro-batches hold different numbers of valid tokens, so dividing
    # each by its own count and averaging re-weights the tokens. The check above must catch it.
    mask = batch[1]
    counts = [int(mask[rows].sum()) for rows in SPLITS["2x4"]]
    assert counts[0] != counts[1]
    full, _ = _accumulated_grads(model, batch, SPLITS["1x8"], token_mean)
    naive, _ = _accumulated_grads(model, batch, SPLITS["2x4"], token_mean, naive=True)
    with pytest.raises(AssertionError):
        assert_close(naive, full)
    flat_full = torch.cat([g.flatten() for g in full.values()])
    flat_naive = torch.cat([g.flatten() for g in naive.values()])
    assert (flat_naive - flat_full).norm() > 0.01 * flat_full.norm()
