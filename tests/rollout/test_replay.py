"""Sampling replay (``SamplingParams.replay``) on the HF engine and the trainer: the engine
reports log-probs of the distribution it sampled from and records its sampler; the trainer
rebuilds the kept set and scores the same distribution.

**The tolerance.** The engine model is float64, but ``generate`` casts each step's logits to
float32 and samples, and reports, in float32; the trainer computes in float64. What is left
is the float32 rounding of the engine's side: the tempered logits s (|s| ≤ S) rounded once,
then s_y − logsumexp(s) with a few more roundings of numbers of size ≤ S, then the float32
result: at most a few ulps of S, bounded here by 8 · S · 2⁻²⁴ (S is measured in the test:
about 12, so ~6e-6; measured differences ≤ 1.2e-6). Without replay the difference is the
log of the kept mass, 0.1 to 1 nats here: far outside.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from rlblocks.interfaces import SamplingParams
from rlblocks.losses import rollout_mismatch
from rlblocks.rollout import HFEngine
from rlblocks.rollout.continuous import ContinuousBatchingEngine
from rlblocks.trainer import PolicyTrainer, TrainConfig
from rlblocks.trainer import forward as forward_module

PROMPTS = ["What is 2+2?", "Hello there, how are you today?", "x"]
T = 0.8
TRUNCATIONS = {"top_k": {"top_k": 5}, "top_p": {"top_p": 0.8}, "both": {"top_k": 20, "top_p": 0.9}}


def sample(model, tokenizer, *, replay: bool = True, **truncation) -> object:
    sampling = SamplingParams(max_new_tokens=8, temperature=T, seed=2, replay=replay,
                              **truncation)  # fmt: skip
    return HFEngine(model, tokenizer, progress=False).generate(
        PROMPTS, group_size=4, sampling=sampling
    )


def trainer(model, tokenizer, **config) -> PolicyTrainer:
    settings = {"temperature": T, "logprob_chunk_size": 5, **config}  # chunks cross rows
    return PolicyTrainer(model, tokenizer=tokenizer, config=TrainConfig(**settings))


def forward_scores(model, ro) -> torch.Tensor:
    """The tempered float32 logits ``(b t v)`` that score each response token: one uncached
    forward, cast as ``generate`` casts them."""
    mask = ro.attention_mask.long()
    with torch.no_grad():
        logits = model(input_ids=ro.input_ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits  # fmt: skip
    tp = ro.prompt_ids.shape[1]
    return logits[:, tp - 1 : -1].float() / T


def kept_mass(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Σ_{j∈K} softmax(s)_j, K what Hugging Face's own warpers keep: ``(b t)``."""
    flat = scores.reshape(-1, scores.shape[-1])
    warped = TopKLogitsWarper(top_k)(None, flat) if top_k else flat
    warped = TopPLogitsWarper(top_p)(None, warped) if top_p < 1 else warped
    mass = torch.where(warped.isinf(), 0.0, flat.double().softmax(-1)).sum(-1)
    return mass.reshape(scores.shape[:-1])


@pytest.fixture(scope="module")
def peaky64(peaky):
    return copy.deepcopy(peaky[0]).double(), peaky[1]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_the_trainer_scores_what_the_engine_sampled_from(peaky64, name, packing):
    model, tokenizer = peaky64
    truncation = TRUNCATIONS[name]
    ro = sample(model, tokenizer, **truncation)
    assert ro.sampler.dtype == torch.float64 and ro.sampler.shape == (12, 3)
    row = [T, truncation.get("top_k", 0), truncation.get("top_p", 1.0)]
    assert ro.sampler.tolist() == [row] * 12
    mask = ro.response_mask
    scores = forward_scores(model, ro)
    bound = 8 * float(scores.abs().max()) * 2**-24

    policy = trainer(model, tokenizer, packing=packing)
    replayed = policy.logprobs(ro)
    torch.testing.assert_close(replayed[mask], ro.rollout_logprobs[mask], rtol=0, atol=bound)

    # Without replay the trainer scores the untruncated distribution: off by the log of the
    # kept mass at every truncated step, as Hugging Face's own warpers give it.
    untruncated = policy.logprobs(ro.replace(sampler=None))
    log_mass = kept_mass(scores, **truncation).log().float()
    torch.testing.assert_close((untruncated - ro.rollout_logprobs)[mask], log_mass[mask],
                               rtol=0, atol=2 * bound)  # fmt: skip
    assert (log_mass[mask] < 0).all() and log_mass[mask].mean() < -0.1  # every step truncated


def test_without_replay_the_engine_reports_the_untruncated_distribution(peaky64):
    """The default is today's: no sampler, log-probs of softmax(z / T), the trainer's own."""
    model, tokenizer = peaky64
    ro = sample(model, tokenizer, replay=False, top_k=5)
    assert ro.sampler is None
    scores = forward_scores(model, ro)
    bound = 8 * float(scores.abs().max()) * 2**-24
    torch.testing.assert_close(trainer(model, tokenizer).logprobs(ro)[ro.response_mask],
                               ro.rollout_logprobs[ro.response_mask], rtol=0, atol=bound)  # fmt: skip


def test_float32_mismatch_with_and_without_replay(peaky):
    """The ``mismatch/*`` metrics on a float32 model under top-p: replay brings them from the
    kept mass's size down to rounding."""
    model, tokenizer = peaky
    ro = sample(model, tokenizer, top_p=0.8)
    policy = trainer(model, tokenizer)
    mask = ro.response_mask
    before = rollout_mismatch(policy.logprobs(ro.replace(sampler=None)), ro.rollout_logprobs, mask)
    after = rollout_mismatch(policy.logprobs(ro), ro.rollout_logprobs, mask)
    assert before["mismatch/abs_mean"] > 0.1
    assert after["mismatch/abs_max"] < 1e-4  # float32 cached vs uncached (test_hf: ≤ 1.5e-5)


def test_the_unchunked_logits_path_replays_too(peaky64, monkeypatch):
    """A model whose head cannot be swapped for the chunked scorer (soft-capping, a scale)
    gets full logits: ``token_logprobs`` and ``entropy_from_logits`` with the rule."""
    model, tokenizer = peaky64
    ro = sample(model, tokenizer, top_k=20, top_p=0.9)
    chunked = trainer(model, tokenizer).logprobs(ro, entropy=True)
    monkeypatch.setattr(forward_module, "_chunkable_head", lambda model: None)
    full = trainer(model, tokenizer).logprobs(ro, entropy=True)
    for a, b in zip(chunked, full, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # float32 of float64 sums
    mask = ro.response_mask
    bound = 8 * float(forward_scores(model, ro).abs().max()) * 2**-24
    torch.testing.assert_close(full[0][mask], ro.rollout_logprobs[mask], rtol=0, atol=bound)


def test_a_row_sampled_at_another_temperature_is_refused(peaky):
    model, tokenizer = peaky
    ro = sample(model, tokenizer, top_k=5)
    sampler = ro.sampler.clone()
    sampler[3, 0] = 1.0
    with pytest.raises(ValueError, match=r"score_responses: row 3 was sampled at temperature 1.0"):
        trainer(model, tokenizer).logprobs(ro.replace(sampler=sampler))


def test_greedy_rows_record_temperature_0_and_score_at_1(peaky):
    model, tokenizer = peaky
    sampling = SamplingParams(max_new_tokens=6, temperature=0, top_k=5, replay=True)
    ro = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, sampling=sampling)
    assert ro.sampler[:, 0].tolist() == [0.0] * 3
    policy = PolicyTrainer(model, tokenizer=tokenizer)  # temperature 1
    torch.testing.assert_close(policy.logprobs(ro)[ro.response_mask],
                               policy.logprobs(ro.replace(sampler=None))[ro.response_mask])  # fmt: skip


# ---------------------------------------------------------------------- ContinuousBatchingEngine
@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_continuous_batching_samples_top_k_top_p_with_replay(peaky64, name):
    """Continuous batching reports log-probs of the scores it sampled from: with replay it takes
    top-k / top-p, records its sampler, and the trainer scores the same distribution."""
    model, tokenizer = peaky64
    truncation = TRUNCATIONS[name]
    sampling = SamplingParams(max_new_tokens=8, temperature=T, seed=2, replay=True, **truncation)
    ro = ContinuousBatchingEngine(model, tokenizer, progress=False).generate(
        PROMPTS, group_size=4, sampling=sampling
    )
    row = [T, truncation.get("top_k", 0), truncation.get("top_p", 1.0)]
    assert ro.sampler.tolist() == [row] * 12
    mask = ro.response_mask
    bound = 8 * float(forward_scores(model, ro).abs().max()) * 2**-24
    policy = trainer(model, tokenizer)
    torch.testing.assert_close(policy.logprobs(ro)[mask], ro.rollout_logprobs[mask], rtol=0,
                               atol=bound)  # fmt: skip
    untruncated = policy.logprobs(ro.replace(sampler=None))
    assert ((untruncated - ro.rollout_logprobs)[mask] < 0).all()  # replay is what agrees


def test_continuous_batching_still_refuses_top_p_without_replay(peaky):
    engine = ContinuousBatchingEngine(peaky[0], peaky[1], progress=False)
    with pytest.raises(ValueError, match=r"SamplingParams.top_p=0.9 is not supported without "
                                         r"replay.*SamplingParams\(replay=True\)"):  # fmt: skip
        engine.generate(PROMPTS, sampling=SamplingParams(max_new_tokens=4, top_p=0.9))
