"""ContinuousBatchingEngine: the RolloutEngine contract of HFEngine (shapes, groups, masks,
rollout log-probs, seeds, stop strings, weights), greedy equality with HF ``generate``, and the
refusals made before any compute. Continuous batching runs on the CPU in transformers 5.19 (its
sdpa/eager paged path), so everything here runs in the default suite; the GPU test adds the
flash-attention / CUDA path where a GPU is present."""

from __future__ import annotations

import copy

import pytest
import torch
from builders import VOCAB, tiny_trainer
from engine_cases import (
    PROMPTS,
    U32,
    count_forwards,
    logprob_bound,
    peaky_eos,
    same_rollouts,
)
from torch import nn
from transformers import BloomConfig, BloomForCausalLM

from rlblocks.interfaces import RolloutEngine, SamplingParams
from rlblocks.models import tiny
from rlblocks.resharder import Resharder
from rlblocks.rollout import ContinuousBatchingEngine, HFEngine, continuous

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


def engine(model_and_tokenizer, **kwargs) -> ContinuousBatchingEngine:
    model, tokenizer = model_and_tokenizer
    return ContinuousBatchingEngine(model, tokenizer, progress=False, **kwargs)


# ---------------------------------------------------------------------- contract
def test_is_a_rollout_engine(peaky):
    eng = engine(peaky)
    assert isinstance(eng, RolloutEngine)
    assert eng.weights_version == 0 and eng.model is peaky[0] and eng.tokenizer is peaky[1]
    assert eng.serves_adapters is False
    eng.sleep()
    eng.wake_up()  # nothing held between calls: both are no-ops
    with pytest.raises(NotImplementedError, match="^ContinuousBatchingEngine.load_adapter: "):
        eng.load_adapter("anywhere", version=1)


def test_shapes_groups_and_metadata(peaky):
    tokenizer = peaky[1]
    metadata = [{"answer": "4", "tags": ["a"]}, {"answer": "?"}, {}, {"i": 3}]
    sampling = SamplingParams(max_new_tokens=6, seed=0)
    ro = engine(peaky).generate(PROMPTS, group_size=3, sampling=sampling, metadata=metadata)
    # b = p · g = 4 · 3 rows; the rows of prompt i are consecutive and carry group id i. The
    # one-token prompt "x" is forked too (transformers keeps one prompt token to fork on).
    assert ro.batch_size == 12 and ro.response_ids.shape == (12, 6)
    assert ro.group_ids.tolist() == [i for i in range(4) for _ in range(3)]
    assert ro.prompts == [p for p in PROMPTS for _ in range(3)]
    assert ro.metadata == [m for m in metadata for _ in range(3)]
    ro.metadata[0]["answer"] = "changed"  # a fresh dict per row: no aliasing
    assert ro.metadata[1]["answer"] == "4" and metadata[0]["answer"] == "4"
    assert ro.rollout_logprobs.dtype == torch.float32 and not ro.rollout_logprobs.requires_grad
    assert ro.response_mask.dtype == torch.bool
    for i in range(12):
        valid = ro.response_ids[i][ro.response_mask[i]].tolist()
        assert ro.completions[i] == tokenizer.decode(valid, skip_special_tokens=True)
        prompt = ro.prompt_ids[i][ro.prompt_mask[i]].tolist()
        assert prompt == tokenizer(ro.prompts[i])["input_ids"]  # left-padded prompt ids
    # The forks of one prompt sample their own tokens: no two rows of a group are the same.
    for g in range(4):
        group = ro.response_ids[3 * g : 3 * g + 3]
        assert len({tuple(r) for r in group.tolist()}) == 3


def test_chat_prompts_are_templated_like_hf(peaky):
    messages = [[{"role": "user", "content": "What is 2+2?"}], "plain"]
    cb = engine(peaky, chat=True).generate(messages, sampling=GREEDY)
    hf = HFEngine(*peaky, chat=True, progress=False).generate(messages, sampling=GREEDY)
    assert cb.prompts == hf.prompts and "<|im_start|>user" in cb.prompts[1]
    assert torch.equal(cb.prompt_ids, hf.prompt_ids)


# ---------------------------------------------------------------------- greedy = HF generate
def test_greedy_equals_hf_generate():
    # In float64 the engine's packed, paged forward and generate's padded, cached one give
    # logits within ~1e-13 of each other; both round them to float32 and take the argmax. So
    # the tokens are the same whenever, at every step, the best logit beats the second by more
    # than the rounding to float32 can move them (2 ulps of the largest logit): asserted on the
    # reference's own logits first, then the tokens must be equal, not close.
    model, tokenizer = peaky_eos()
    cb = engine((model, tokenizer)).generate(PROMPTS, sampling=GREEDY)
    hf = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, sampling=GREEDY)
    with torch.no_grad():
        logits = model(hf.input_ids, attention_mask=hf.attention_mask.long()).logits
    tp = hf.prompt_ids.shape[1]
    top2 = logits[:, tp - 1 : -1].topk(2, dim=-1).values  # the logits each token was picked from
    margin = (top2[..., 0] - top2[..., 1])[hf.response_mask]
    assert margin.min() > 4 * U32 * logits.abs().max()  # the premise holds on this model
    assert hf.response_mask.sum(-1).tolist() == [3, 12, 6, 5]  # ended at different steps
    same_rollouts(cb, hf)
    bound = logprob_bound(model, hf, 1.0)
    torch.testing.assert_close(cb.rollout_logprobs, hf.rollout_logprobs, atol=bound, rtol=0)


# ---------------------------------------------------------------------- rollout log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_forward_pass(peaky, forward_logprobs, temperature):
    model = copy.deepcopy(peaky[0]).double()
    sampling = SamplingParams(max_new_tokens=10, temperature=temperature, seed=1)
    ro = engine((model, peaky[1])).generate(PROMPTS, group_size=3, sampling=sampling)
    ref = forward_logprobs(model, ro, temperature)
    bound = logprob_bound(model, ro, temperature)
    torch.testing.assert_close(ro.rollout_logprobs, ref, atol=bound, rtol=0)
    assert (ro.rollout_logprobs[ro.response_mask] < 0).all()  # untruncated, never log 1


def test_logprobs_equal_the_trainers_scoring():
    # The engine shares the trainer's float64 module: the PPO ratio of a fresh rollout is 1 up
    # to the engine's float32 softmax (the bound of logprob_bound; the trainer's float64 scoring
    # adds only its cast to float32, within it).
    policy = tiny_trainer(torch.float64, model_config={"initializer_range": 0.3})
    eng = ContinuousBatchingEngine(policy.model, policy.tokenizer, progress=False)
    sampling = SamplingParams(max_new_tokens=10, seed=4)
    ro = eng.generate(PROMPTS, group_size=2, sampling=sampling)
    scored = policy.logprobs(ro)
    bound = logprob_bound(policy.model, ro, 1.0)
    torch.testing.assert_close(ro.rollout_logprobs, scored, atol=bound, rtol=0)


# ---------------------------------------------------------------------- stop strings, seeds
def test_stop_strings_end_rows_like_hf():
    # generate_batch knows no stop strings: the engine cuts each row at the token completing
    # the first one, with HFEngine's matcher. Greedy, row 1 reads "6", "ven", ..., "ven" again
    # at its 7th token, and row 2 "bt", "w", " s", ?, "istan", EOS: "ven" ends row 1 at its 2nd
    # token (the first occurrence), "istan" row 2 at its 5th (before its EOS); rows 0 and 3
    # hold neither and keep their EOS.
    model, tokenizer = peaky_eos()
    plain = engine((model, tokenizer)).generate(PROMPTS, sampling=GREEDY)
    assert plain.completions[1].count("ven") == 3 and plain.completions[2].endswith("istan")
    sampling = SamplingParams(max_new_tokens=12, temperature=0, stop=("ven", "istan"))
    cb = engine((model, tokenizer)).generate(PROMPTS, sampling=sampling)
    hf = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, sampling=sampling)
    assert cb.response_mask.sum(-1).tolist() == [3, 2, 5, 5]
    assert cb.completions[1] == "6ven"
    same_rollouts(cb.trim(), hf.trim())
    assert torch.equal(cb.rollout_logprobs[:, :2], plain.rollout_logprobs[:, :2])  # same steps


def test_same_seed_same_rollouts_and_global_rng_untouched(peaky):
    eng = engine(peaky)
    state = torch.get_rng_state()
    a = eng.generate(PROMPTS, group_size=2, sampling=SamplingParams(max_new_tokens=8, seed=7))
    b = eng.generate(PROMPTS, group_size=2, sampling=SamplingParams(max_new_tokens=8, seed=7))
    assert torch.equal(torch.get_rng_state(), state)  # transformers seeds the global RNG: forked
    same_rollouts(a, b)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    c = eng.generate(PROMPTS, group_size=2, sampling=SamplingParams(max_new_tokens=8, seed=8))
    assert not torch.equal(a.response_ids, c.response_ids)


def test_without_seed_the_global_rng_is_used(peaky):
    eng = engine(peaky)
    sampling = SamplingParams(max_new_tokens=8)
    torch.manual_seed(11)
    a = eng.generate(PROMPTS, group_size=2, sampling=sampling)
    after = torch.get_rng_state()
    torch.manual_seed(11)
    b = eng.generate(PROMPTS, group_size=2, sampling=sampling)
    same_rollouts(a, b)
    torch.manual_seed(11)
    assert not torch.equal(torch.get_rng_state(), after)  # sampling changed the global RNG


def test_a_small_cache_queues_rows_and_gives_the_same_tokens():
    # max_concurrent=1 and one page: the rows decode one after another, each in the page the
    # previous one freed; greedy tokens are those of one batch (the argument of the greedy test).
    model, tokenizer = peaky_eos()
    whole = engine((model, tokenizer)).generate(PROMPTS, sampling=GREEDY)
    one = engine((model, tokenizer), max_concurrent=1, cache_tokens=256)
    same_rollouts(whole, one.generate(PROMPTS, sampling=GREEDY))


forks = pytest.param(
    True,
    marks=pytest.mark.skipif(
        not continuous.FORKS_RETURNED,
        reason="transformers < 5.18 leaves the forks out of generate_batch's result",
    ),
)


@pytest.mark.parametrize("forked", [forks, False], ids=["forks", "one-request-per-row"])
def test_every_row_comes_back_from_a_small_cache(eos_biased, forward_logprobs, monkeypatch, forked):
    # On a GPU with transformers 5.17, 64 prompts × 4 samples came back as 64 rows of 256
    # (generate_batch dropped the forks of each prompt's request). Here 64 prompts of 1–259
    # tokens × g = 4, EOS sampled often (bias 3: p ≈ 20 / (383 + 20) ≈ 0.05 a step) so rows end
    # at many different steps, and a cache of 3 pages of 256 tokens (max_concurrent 16, but each
    # row holds a page of its own): rows queue for a page, and a row whose prompt + response
    # crosses 256 tokens needs a second one, which transformers frees by offloading another row
    # (7 to 9 times a run, counted with transformers 5.17 and 5.19). Both ways of asking for g
    # samples (forks, one request per row) must give every row, in order.
    monkeypatch.setattr(continuous, "FORKS_RETURNED", forked)
    model, tokenizer = eos_biased(3.0)
    model = model.double()  # float64: the log-prob bound below holds (logprob_bound)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 260, (64,), generator=gen).tolist()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    eng = engine((model, tokenizer), max_concurrent=16, cache_tokens=3 * 256)
    new = 40
    ro = eng.generate(prompts, group_size=4, sampling=SamplingParams(max_new_tokens=new, seed=0))
    assert ro.batch_size == 256
    assert ro.group_ids.tolist() == [i for i in range(64) for _ in range(4)]
    for k in range(256):  # row k holds prompt k // 4, left-padded
        assert ro.prompt_ids[k][ro.prompt_mask[k]].tolist() == prompts[k // 4]
    # Each row ends at its first EOS (kept) or at max_new_tokens: one EOS at most, the last token.
    n = ro.response_mask.sum(-1)
    last = ro.response_ids[torch.arange(256), n - 1]
    eos = ro.response_ids.eq(tokenizer.eos_token_id) & ro.response_mask
    assert (last.eq(tokenizer.eos_token_id) | n.eq(new)).all()
    assert eos.sum(-1).le(1).all() and last.eq(tokenizer.eos_token_id).sum() > 200
    assert len(set(n.tolist())) > 20  # rows of many lengths ...
    assert (torch.tensor(lengths).repeat_interleave(4) + n > 256).sum() >= 5  # ... some on 2 pages
    # The samples of a prompt are its own: no group of 4 identical rows.
    groups = ro.response_ids.view(64, 4, -1).tolist()
    assert all(len({tuple(r) for r in group}) > 1 for group in groups)
    # Each row's log-probs are those of its own prompt and response: a row attached to another
    # prompt (or another row's tokens) would be off by far more than the float32 softmax.
    ref = forward_logprobs(model, ro, 1.0)
    bound = logprob_bound(model, ro, 1.0)
    torch.testing.assert_close(ro.rollout_logprobs, ref, atol=bound, rtol=0)


# ---------------------------------------------------------------------- model state, weights
def test_model_state_is_restored(peaky):
    model, tokenizer = peaky
    saved, attention = model.generation_config, model.config._attn_implementation
    saved.repetition_penalty = 50.0  # would change greedy decoding if it leaked in
    model.train()
    try:
        ro = engine(peaky).generate(PROMPTS, sampling=GREEDY)
        assert model.training
    finally:
        model.eval()
        saved.repetition_penalty = 1.0
    assert model.generation_config is saved and model.config._attn_implementation == attention
    assert all(p.grad is None for p in model.parameters()) and not ro.rollout_logprobs.requires_grad
    clean = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, sampling=GREEDY)
    assert torch.equal(ro.response_ids[:, :1], clean.response_ids[:, :1])


def test_shared_model_sees_updates_and_resharder_syncs_a_copy():
    policy = tiny_trainer(model_config={"initializer_range": 0.3})
    shared = ContinuousBatchingEngine(policy.model, policy.tokenizer, progress=False)
    own = ContinuousBatchingEngine(tiny(seed=1)[0], policy.tokenizer, progress=False)
    resharder = Resharder()
    before = shared.generate(PROMPTS, sampling=GREEDY)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # an "update" of the trainer's weights
    assert resharder.sync(policy, shared)["sync/bytes"] == 0  # shared: nothing moves
    resharder.sync(policy, own)
    assert (shared.weights_version, own.weights_version, resharder.version) == (1, 2, 2)
    after = shared.generate(PROMPTS, sampling=GREEDY)
    assert not torch.equal(before.response_ids, after.response_ids)
    same_rollouts(after, own.generate(PROMPTS, sampling=GREEDY))


def test_update_weights_errors_name_the_engine(peaky):
    eng = ContinuousBatchingEngine(copy.deepcopy(peaky[0]), peaky[1], progress=False)
    with pytest.raises(ValueError, match="^ContinuousBatchingEngine.update_weights: the model "):
        eng.update_weights([("model.not_a_layer.weight", torch.zeros(3))], version=1)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        eng.update_weights([("model.norm.weight", torch.zeros(3))], version=1)
    assert eng.weights_version == 0
    assert eng.weight_spec() == HFEngine(*peaky).weight_spec()


# ---------------------------------------------------------------------- refusals, before compute
@pytest.mark.parametrize(("field", "value"), [("top_k", 20), ("top_p", 0.9), ("min_new_tokens", 2)])
def test_sampling_it_cannot_honour_is_refused(peaky, field, value):
    model = copy.deepcopy(peaky[0])
    calls = count_forwards(model)
    eng = ContinuousBatchingEngine(model, peaky[1], progress=False)
    params = SamplingParams(max_new_tokens=4, **{field: value})
    message = f"^ContinuousBatchingEngine: SamplingParams.{field}={value} is not supported"
    with pytest.raises(ValueError, match=message):
        eng.generate(PROMPTS, sampling=params)
    with pytest.raises(ValueError, match=message):
        ContinuousBatchingEngine(model, peaky[1], sampling=params)
    assert calls[0] == 0


def test_a_row_the_cache_cannot_hold_is_refused_before_compute(peaky):
    model = copy.deepcopy(peaky[0])
    calls = count_forwards(model)
    eng = ContinuousBatchingEngine(model, peaky[1], cache_tokens=256, progress=False)
    long = [7] * 250  # 250 prompt tokens + 10 new ones need 2 pages of 256 tokens
    with pytest.raises(ValueError, match=r"prompt 1 has 250 tokens; .* needs 512 tokens of paged "
                       r"cache .* cache_tokens=256 holds; raise cache_tokens to at least 512"):  # fmt: skip
        eng.generate(["x", long], sampling=SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="prompt 0 has 600 tokens, which is longer than the "
                       "model's context of 512"):  # fmt: skip
        eng.generate([[7] * 600], sampling=SamplingParams(max_new_tokens=10))
    assert calls[0] == 0


def test_a_model_it_cannot_page_is_refused(peaky):
    _, tokenizer = peaky
    with pytest.raises(TypeError, match="the model is a Linear, which has no .generate_batch"):
        ContinuousBatchingEngine(nn.Linear(2, 2), tokenizer)
    flex, _ = tiny()
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="Qwen2ForCausalLM runs attention_implementation="
                       "'flex_attention', which transformers cannot page"):  # fmt: skip
        ContinuousBatchingEngine(flex, tokenizer)
    # Bloom's attention takes none of transformers' attention backends, so no paged cache
    bloom = BloomForCausalLM(BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_layer=2))
    with pytest.raises(ValueError, match="model BloomForCausalLM does not take transformers' "
                       "attention backends"):  # fmt: skip
        ContinuousBatchingEngine(bloom, tokenizer)
    linear, _ = tiny(layer_types=["full_attention", "linear_attention"])
    with pytest.raises(ValueError, match=r"has layers of type \['linear_attention'\]"):
        ContinuousBatchingEngine(linear, tokenizer)


def test_bad_arguments_raise_clear_errors(peaky):
    eng = engine(peaky)
    with pytest.raises(ValueError, match="group_size=0; use group_size >= 1"):
        eng.generate(PROMPTS, group_size=0)
    with pytest.raises(ValueError, match="prompts is empty"):
        eng.generate([])
    with pytest.raises(ValueError, match="2 metadata entries for 4 prompts"):
        eng.generate(PROMPTS, metadata=[{}, {}])
    for knob in ("max_concurrent", "cache_tokens"):
        with pytest.raises(
            ValueError, match=f"^ContinuousBatchingEngine: {knob}=0; use {knob} >= 1"
        ):
            ContinuousBatchingEngine(*peaky, **{knob: 0})


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_equals_hf_generate_on_a_gpu():
    # On a GPU transformers may switch sdpa to flash attention and use CUDA graphs: the same
    # equality as on the CPU, in float64 where the kernels allow (sdpa; flash needs half
    # precision, so float64 keeps sdpa), and the attention implementation is restored.
    model, tokenizer = peaky_eos()
    model = model.cuda()
    cb = engine((model, tokenizer)).generate(PROMPTS, sampling=GREEDY)
    hf = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, sampling=GREEDY)
    same_rollouts(cb, hf)
    bound = logprob_bound(model, hf.to("cuda"), 1.0)
    torch.testing.assert_close(cb.rollout_logprobs, hf.rollout_logprobs, atol=bound, rtol=0)
    assert model.config._attn_implementation == "sdpa"
