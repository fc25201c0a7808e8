"""CompiledEngine: the RolloutEngine contract of HFEngine, greedy equality with HF ``generate``,
rollout log-probs against the trainer's scoring, weight syncs, the decode step compiled whole
(``fullgraph=True``) without recompiles after warm-up, rows that end stop costing, and the
refusals made before any compute. Most tests run the step eagerly (the engine's default on a
CPU); the compile tests run inductor on the CPU, as CUDA would run it minus the CUDA graphs."""

from __future__ import annotations

import copy

import pytest
import torch
from builders import tiny_trainer
from engine_cases import (
    PROMPTS,
    U32,
    count_forwards,
    greedy_margin,
    logprob_bound,
    peaky_eos,
    same_rollouts,
)
from torch import nn

from rlblocks.interfaces import RolloutEngine, SamplingParams
from rlblocks.losses.truncation import kept_tokens
from rlblocks.models import tiny
from rlblocks.resharder import Resharder
from rlblocks.rollout import CompiledEngine, HFEngine
from rlblocks.rollout.compiled import row_bucket
from rlblocks.rollout.decode import Sampler, choose, kept_set

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


def engine(model_and_tokenizer, **kwargs) -> CompiledEngine:
    model, tokenizer = model_and_tokenizer
    return CompiledEngine(model, tokenizer, progress=False, **kwargs)


def rows_per_forward(model: nn.Module) -> list[int]:
    """The row count of every forward of ``model`` (a pre-hook on its decoder stack)."""
    rows: list[int] = []
    model.model.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    return rows


# ---------------------------------------------------------------------- contract
def test_is_a_rollout_engine(peaky):
    eng = engine(peaky)
    assert isinstance(eng, RolloutEngine)
    assert eng.weights_version == 0 and eng.model is peaky[0] and eng.tokenizer is peaky[1]
    assert eng.serves_adapters is False and eng.compiled is False  # eager on a CPU
    eng.generate(PROMPTS, sampling=SamplingParams(max_new_tokens=3))
    assert eng._cache is not None
    eng.sleep()  # frees the cache kept between calls
    assert eng._cache is None
    eng.wake_up()
    with pytest.raises(NotImplementedError, match="^CompiledEngine.load_adapter: "):
        eng.load_adapter("anywhere", version=1)


def test_shapes_groups_and_metadata(peaky):
    tokenizer = peaky[1]
    metadata = [{"answer": "4", "tags": ["a"]}, {"answer": "?"}, {}, {"i": 3}]
    sampling = SamplingParams(max_new_tokens=6, seed=0)
    ro = engine(peaky).generate(PROMPTS, group_size=3, sampling=sampling, metadata=metadata)
    assert ro.batch_size == 12 and ro.response_ids.shape == (12, 6)
    assert ro.group_ids.tolist() == [i for i in range(4) for _ in range(3)]
    assert ro.prompts == [p for p in PROMPTS for _ in range(3)]
    assert ro.metadata == [m for m in metadata for _ in range(3)]
    ro.metadata[0]["answer"] = "changed"  # a fresh dict per row: no aliasing
    assert ro.metadata[1]["answer"] == "4" and metadata[0]["answer"] == "4"
    assert ro.rollout_logprobs.dtype == torch.float32 and not ro.rollout_logprobs.requires_grad
    for i in range(12):
        valid = ro.response_ids[i][ro.response_mask[i]].tolist()
        assert ro.completions[i] == tokenizer.decode(valid, skip_special_tokens=True)
        prompt = ro.prompt_ids[i][ro.prompt_mask[i]].tolist()
        assert prompt == tokenizer(ro.prompts[i])["input_ids"]
    # the samples of one prompt share its prefill, not its randomness
    for g in range(4):
        group = ro.response_ids[3 * g : 3 * g + 3]
        assert len({tuple(r) for r in group.tolist()}) == 3


# ---------------------------------------------------------------------- greedy = HF generate
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_equals_hf_generate(dtype):
    # The engine prefills each prompt once against a static cache and decodes with an additive
    # mask; generate prefills every padded row and grows its cache. The logits then differ by
    # the rounding of other operation orders: ~1e-13 in float64; in float32, a 2-layer model of
    # width 64 accumulates at most ~(2 layers · 64 terms)·u ≈ 8e-6 of its largest logit. So the
    # argmax is the same whenever, at every step, the best logit beats the second by more than
    # that: asserted first on the reference's own logits (4u in float64, 1e-4 in float32: ten
    # times the float32 estimate), then the tokens must be equal, not close.
    model, tokenizer = peaky_eos(dtype=dtype)
    ours = engine((model, tokenizer)).generate(PROMPTS, group_size=2, sampling=GREEDY)
    hf = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, group_size=2, sampling=GREEDY)
    margin, largest = greedy_margin(model, hf)
    assert margin > (4 * U32 if dtype == torch.float64 else 1e-4) * largest  # the premise
    assert hf.response_mask.sum(-1).tolist() == [3, 3, 12, 12, 6, 6, 5, 5]
    same_rollouts(ours, hf)
    if dtype == torch.float64:
        bound = logprob_bound(model, hf, 1.0)
        torch.testing.assert_close(ours.rollout_logprobs, hf.rollout_logprobs, atol=bound, rtol=0)


def test_eager_attention_takes_the_mask_too():
    # Eager attention adds the engine's mask to its scores and takes the softmax in float32: in
    # float32 the tokens are HFEngine's (the premise of the greedy test holds for this model);
    # in float64 the masked value must stay finite in float32 (float64's lowest would be -inf
    # there, and a padding query with every key masked would give NaN), and the tokens are
    # those of sdpa.
    model, tokenizer = peaky_eos(dtype=torch.float32)
    model.config._attn_implementation = "eager"
    ours = engine((model, tokenizer)).generate(PROMPTS, sampling=GREEDY)
    same_rollouts(
        ours, HFEngine(model, tokenizer, progress=False).generate(PROMPTS, sampling=GREEDY)
    )
    model, tokenizer = peaky_eos()
    sdpa = engine((model, tokenizer)).generate(PROMPTS, sampling=GREEDY)
    model.config._attn_implementation = "eager"
    same_rollouts(engine((model, tokenizer)).generate(PROMPTS, sampling=GREEDY), sdpa)


def test_rows_that_end_stop_costing():
    # 4 prompts x 2 greedy samples end after 3, 3, 12, 12, 6, 6, 5, 5 tokens (at steps 2, 2,
    # 11, 11, 5, 5, 4, 4). The engine reads the rows still going every 4 steps and moves them to
    # the front when they fit three quarters of the slots (eager): steps 1-3 decode 8 rows; at
    # step 4 rows 0, 1 have ended, 6 live <= 0.75·8, so steps 4-7 decode 6; at step 8 only the
    # 2 rows of prompt 1 are going, steps 8-11 decode 2.
    model, tokenizer = peaky_eos()
    rows = rows_per_forward(model)
    ro = engine((model, tokenizer)).generate(PROMPTS, group_size=2, sampling=GREEDY)
    assert ro.response_mask.sum(-1).tolist() == [3, 3, 12, 12, 6, 6, 5, 5]
    # one prefill of the 4 prompts, then steps 1..11 (step 0 comes from the prefill)
    assert rows == [4] + [8] * 3 + [6] * 4 + [2] * 4


def test_row_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 6, 7, 9, 13, 48, 49, 190, 200, 256)] == [
        2, 2, 3, 4, 6, 6, 8, 12, 16, 48, 64, 192, 256, 256,
    ]  # fmt: skip


# ---------------------------------------------------------------------- rollout log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_forward_pass(peaky, forward_logprobs, temperature):
    model = copy.deepcopy(peaky[0]).double()
    sampling = SamplingParams(max_new_tokens=10, temperature=temperature, seed=1)
    ro = engine((model, peaky[1])).generate(PROMPTS, group_size=3, sampling=sampling)
    ref = forward_logprobs(model, ro, temperature)
    torch.testing.assert_close(ro.rollout_logprobs, ref, atol=logprob_bound(model, ro, temperature),
                               rtol=0)  # fmt: skip
    assert (ro.rollout_logprobs[ro.response_mask] < 0).all()


def test_logprobs_equal_the_trainers_scoring():
    # The engine shares the trainer's float64 module: the PPO ratio of a fresh rollout is 1 up
    # to the engine's float32 softmax (logprob_bound).
    policy = tiny_trainer(torch.float64, model_config={"initializer_range": 0.3})
    eng = CompiledEngine(policy.model, policy.tokenizer, progress=False)
    ro = eng.generate(PROMPTS, group_size=2, sampling=SamplingParams(max_new_tokens=10, seed=4))
    bound = logprob_bound(policy.model, ro, 1.0)
    torch.testing.assert_close(ro.rollout_logprobs, policy.logprobs(ro), atol=bound, rtol=0)


def test_replay_logprobs_equal_the_trainers_truncated_scoring():
    # With top-k / top-p and replay the rollout log-probs are those of the truncated
    # distribution; the trainer rebuilds the kept set from Rollouts.sampler and scores the same.
    policy = tiny_trainer(torch.float64, model_config={"initializer_range": 0.3})
    eng = CompiledEngine(policy.model, policy.tokenizer, progress=False)
    sampling = SamplingParams(max_new_tokens=10, top_k=20, top_p=0.9, replay=True, seed=2)
    ro = eng.generate(PROMPTS, group_size=2, sampling=sampling)
    assert ro.sampler is not None and ro.sampler[0].tolist() == [1.0, 20.0, 0.9]
    bound = logprob_bound(policy.model, ro, 1.0)
    torch.testing.assert_close(ro.rollout_logprobs, policy.logprobs(ro), atol=bound, rtol=0)


def test_sampling_picks_each_token_with_its_probability():
    # Logits (0, 1, 2, -1, -inf) in n = 200,000 rows, one draw each: every token's frequency is
    # within 5 binomial standard deviations sqrt(p(1-p)/n) of its probability (a false alarm
    # about once in 2 million per token); the -inf token is never drawn. With top_k=2 only the
    # two best are drawn, renormalized; with EOS held back (token 2 as EOS here) it never is.
    n = 200_000
    z = torch.tensor([0.0, 1.0, 2.0, -1.0, -float("inf")]).expand(n, 5)
    args = {"temperature": torch.tensor(1.0), "step": torch.tensor(0),
            "min_new_tokens": torch.tensor(3), "eos": torch.tensor([2])}  # fmt: skip
    for sampler, p in [
        (Sampler(greedy=False), torch.softmax(z[0], -1)),
        (Sampler(greedy=False, top_k=2), torch.softmax(torch.tensor([-9e9, 1, 2, -9e9, -9e9]), -1)),
        (Sampler(greedy=False, holds_eos=True),
         torch.softmax(torch.tensor([0.0, 1.0, -float("inf"), -1.0, -float("inf")]), -1)),
    ]:  # fmt: skip
        torch.manual_seed(0)
        tokens, logprobs, broken = choose(z, sampler=sampler, **args)
        freq = torch.bincount(tokens, minlength=5) / n
        assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt()).all(), (sampler, freq, p)
        assert (freq[p == 0] == 0).all() and not broken.any()
        # the log-probs are those of the untruncated distribution (no replay)
        torch.testing.assert_close(logprobs, torch.log_softmax(z[0], -1)[tokens])


def test_kept_set_is_the_truncation_rule():
    z = torch.randn(16, 384, generator=torch.Generator().manual_seed(0)) * 3
    for top_k, top_p in [(0, 0.9), (20, 1.0), (20, 0.8), (1, 0.5), (0, 1.0)]:
        n = z.shape[0]
        ref = kept_tokens(z, torch.full((n,), top_k), torch.full((n,), top_p))
        assert torch.equal(kept_set(z, top_k=top_k, top_p=top_p), ref), (top_k, top_p)


# ---------------------------------------------------------------------- sampling settings
def test_min_new_tokens_holds_eos_back_and_stop_strings_end_rows_like_hf():
    model, tokenizer = peaky_eos()
    held = SamplingParams(max_new_tokens=12, temperature=0, min_new_tokens=5)
    ours = engine((model, tokenizer)).generate(PROMPTS, sampling=held)
    hf = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, sampling=held)
    assert ours.response_mask.sum(-1).min() >= 5
    same_rollouts(ours, hf)
    # greedy: row 1 reads "ven" at its 2nd token, row 2 "istan" at its 5th (before its EOS)
    stops = SamplingParams(max_new_tokens=12, temperature=0, stop=("ven", "istan"))
    ours = engine((model, tokenizer)).generate(PROMPTS, sampling=stops)
    hf = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, sampling=stops)
    assert ours.response_mask.sum(-1).tolist() == [3, 2, 5, 5] and ours.completions[1] == "6ven"
    same_rollouts(ours.trim(), hf.trim())


def test_same_seed_same_rollouts_and_global_rng_untouched(peaky):
    eng = engine(peaky)
    state = torch.get_rng_state()
    a = eng.generate(PROMPTS, group_size=2, sampling=SamplingParams(max_new_tokens=8, seed=7))
    b = eng.generate(PROMPTS, group_size=2, sampling=SamplingParams(max_new_tokens=8, seed=7))
    assert torch.equal(torch.get_rng_state(), state)
    same_rollouts(a, b)
    assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    c = eng.generate(PROMPTS, group_size=2, sampling=SamplingParams(max_new_tokens=8, seed=8))
    assert not torch.equal(a.response_ids, c.response_ids)


def test_max_batch_size_decodes_in_chunks_with_the_same_tokens():
    model, tokenizer = peaky_eos()
    whole = engine((model, tokenizer)).generate(PROMPTS, group_size=2, sampling=GREEDY)
    parts = engine((model, tokenizer), max_batch_size=3).generate(PROMPTS, group_size=2,
                                                                  sampling=GREEDY)  # fmt: skip
    same_rollouts(whole.trim(), parts.trim())


# ---------------------------------------------------------------------- weights
def test_shared_model_sees_updates_and_resharder_syncs_a_copy():
    policy = tiny_trainer(model_config={"initializer_range": 0.3})
    shared = CompiledEngine(policy.model, policy.tokenizer, progress=False)
    own = CompiledEngine(tiny(seed=1)[0], policy.tokenizer, progress=False)
    resharder = Resharder()
    before = shared.generate(PROMPTS, sampling=GREEDY)
    torch.manual_seed(0)  # the same "update" in every run
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    assert resharder.sync(policy, shared)["sync/bytes"] == 0
    resharder.sync(policy, own)
    after = shared.generate(PROMPTS, sampling=GREEDY)
    assert not torch.equal(before.response_ids, after.response_ids)
    same_rollouts(after, own.generate(PROMPTS, sampling=GREEDY))


def test_broken_weights_raise_instead_of_decoding_garbage(peaky):
    model = copy.deepcopy(peaky[0])
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="^CompiledEngine.generate: the model's "
                       "next-token scores are not finite"):  # fmt: skip
        engine((model, peaky[1])).generate(PROMPTS, sampling=GREEDY)


# ---------------------------------------------------------------------- compiled whole
@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_the_step_compiles_whole_and_never_recompiles_after_warm_up(fresh_dynamo):
    # fullgraph=True: a graph break is an error. The first call compiles the step once (rows
    # and columns dynamic); a second call of other prompt lengths, other row counts and rows
    # ending at other steps (other buckets after compaction) runs under fail_on_recompile.
    model, tokenizer = peaky_eos(dtype=torch.float32)
    compiled = engine((model, tokenizer), compile=True)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=0)
    compiled.generate(PROMPTS, group_size=4, sampling=sampling)  # warm-up: 16 rows
    assert fresh_dynamo["stats"]["unique_graphs"] == 1
    other = ["a much longer prompt than any of the first ones, with words", "y", "2+2"]
    with torch.compiler.set_stance("fail_on_recompile"):
        ro = compiled.generate(other, group_size=3, sampling=sampling)  # 9 rows, other lengths
    assert len(set(ro.response_mask.sum(-1).tolist())) > 2  # rows ended at several steps
    assert fresh_dynamo["stats"]["unique_graphs"] == 1
    # and the compiled step decodes what the eager one does
    eager = engine((model, tokenizer)).generate(PROMPTS, group_size=2, sampling=GREEDY)
    same_rollouts(compiled.generate(PROMPTS, group_size=2, sampling=GREEDY), eager)


def test_a_compiled_engine_sees_synced_weights(fresh_dynamo):
    # A sync copies in place: the compiled graph reads the new values (nothing is rebound), so
    # its greedy tokens are the eager engine's on the new weights.
    policy = tiny_trainer(model_config={"initializer_range": 0.3})
    own = CompiledEngine(copy.deepcopy(policy.model), policy.tokenizer, progress=False,
                         compile=True)  # fmt: skip
    before = own.generate(PROMPTS, sampling=GREEDY)
    torch.manual_seed(0)  # the same "update" in every run
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    Resharder().sync(policy, own)
    after = own.generate(PROMPTS, sampling=GREEDY)
    assert not torch.equal(before.response_ids, after.response_ids)
    hf = HFEngine(policy.model, policy.tokenizer, progress=False).generate(PROMPTS, sampling=GREEDY)
    margin, largest = greedy_margin(policy.model, hf)  # float32: the premise of the greedy test
    assert margin > 1e-4 * largest
    same_rollouts(after, hf)
    assert fresh_dynamo["stats"]["unique_graphs"] == 1


# ---------------------------------------------------------------------- refusals
def test_models_it_cannot_serve_are_refused(peaky):
    _, tokenizer = peaky
    with pytest.raises(TypeError, match="^CompiledEngine: the model is a Linear, not a Hugging"):
        CompiledEngine(nn.Linear(2, 2), tokenizer)
    flash, _ = tiny()
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention_implementation='flash_attention_2', which "
                       "does not take the engine's static-cache mask"):  # fmt: skip
        CompiledEngine(flash, tokenizer)
    sliding, _ = tiny(layer_types=["full_attention", "sliding_attention"], sliding_window=8,
                      use_sliding_window=True)  # fmt: skip
    with pytest.raises(ValueError, match="has sliding-window attention .* use rb.rollout.HFEngine"):
        CompiledEngine(sliding, tokenizer)


def test_bad_input_is_refused_before_compute(peaky):
    model = copy.deepcopy(peaky[0])
    calls = count_forwards(model)
    eng = CompiledEngine(model, peaky[1], progress=False)
    with pytest.raises(ValueError, match="prompt 0 has 600 tokens, which is longer than the "
                       "model's context of 512"):  # fmt: skip
        eng.generate([[7] * 600], sampling=SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="group_size=0; use group_size >= 1"):
        eng.generate(PROMPTS, group_size=0)
    with pytest.raises(ValueError, match="2 metadata entries for 4 prompts"):
        eng.generate(PROMPTS, metadata=[{}, {}])
    with pytest.raises(ValueError, match="^CompiledEngine: max_batch_size=0; use"):
        CompiledEngine(model, peaky[1], max_batch_size=0)
    assert calls[0] == 0


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_step_is_captured_and_decodes_what_generate_does(fresh_dynamo):
    # On CUDA the engine compiles by default, with CUDA graphs (reduce-overhead). The argument
    # of the greedy test holds in float64 (sdpa's math kernel there): the tokens are HF
    # generate's, a second rollout of other shapes compiles nothing more, and after a sync the
    # graphs read the new weights.
    model, tokenizer = peaky_eos()
    model = model.cuda()
    eng = engine((model, tokenizer))
    assert eng.compiled
    ours = eng.generate(PROMPTS, group_size=2, sampling=GREEDY)
    hf = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, group_size=2, sampling=GREEDY)
    same_rollouts(ours, hf)
    sampling = SamplingParams(max_new_tokens=12, seed=0)
    eng.generate(PROMPTS, group_size=3, sampling=sampling)
    with torch.compiler.set_stance("fail_on_recompile"):
        eng.generate(["y", "a longer prompt than the others, with words"], group_size=5,
                     sampling=sampling)  # fmt: skip
    torch.manual_seed(0)  # the same "update" in every run
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    after = eng.generate(PROMPTS, group_size=2, sampling=GREEDY)
    same_rollouts(after, HFEngine(model, tokenizer, progress=False).generate(
        PROMPTS, group_size=2, sampling=GREEDY))  # fmt: skip
