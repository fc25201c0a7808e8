"""HFEngine: shapes, groups, masks, rollout log-probs, greedy decoding, padding, chunking, seeds,
weight updates. Stop strings and EOS handling are in test_stopping.py, prompt rendering in
test_prompts.py, the log-prob arithmetic in test_sampling.py."""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
import torch

from rlblocks.interfaces import RolloutEngine, SamplingParams
from rlblocks.models import tiny
from rlblocks.rollout import HFEngine
from rlblocks.rollout import hf as hf_module

PROMPTS = ["What is 2+2?", "Hello there, how are you today?", "x"]  # 3 different lengths
GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


def engine(model_and_tokenizer, **kwargs) -> HFEngine:
    model, tokenizer = model_and_tokenizer
    return HFEngine(model, tokenizer, progress=False, **kwargs)


def same_rollouts(a, b, *, logprobs_exact: bool = True) -> None:
    for name in ("prompt_ids", "response_ids", "attention_mask", "response_mask", "group_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    if logprobs_exact:
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    else:
        torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs)
    assert a.prompts == b.prompts and a.completions == b.completions and a.metadata == b.metadata


# ---------------------------------------------------------------------- shapes, groups, metadata
def test_is_a_rollout_engine(peaky):
    eng = engine(peaky)
    assert isinstance(eng, RolloutEngine)
    assert eng.weights_version == 0 and eng.model is peaky[0] and eng.tokenizer is peaky[1]


def test_shapes_groups_and_metadata(peaky):
    tokenizer = peaky[1]
    metadata = [{"answer": "4", "tags": ["a"]}, {"answer": "?"}, {}]
    sampling = SamplingParams(max_new_tokens=6, seed=0)
    ro = engine(peaky).generate(PROMPTS, group_size=3, sampling=sampling, metadata=metadata)
    # b = p · n = 3 · 3 rows; rows of prompt i are consecutive and carry group id i.
    assert ro.batch_size == 9 and ro.response_ids.shape == (9, 6)
    assert ro.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert ro.prompts == [p for p in PROMPTS for _ in range(3)]  # raw text is used verbatim
    assert ro.metadata == [m for m in metadata for _ in range(3)]
    ro.metadata[0]["answer"] = "changed"  # a fresh dict per row: no aliasing
    assert ro.metadata[1]["answer"] == "4" and metadata[0]["answer"] == "4"
    assert ro.rollout_logprobs.dtype == torch.float32 and not ro.rollout_logprobs.requires_grad
    assert ro.response_mask.dtype == torch.bool
    assert torch.equal(ro.response_attention_mask, ro.response_mask)  # no observation tokens
    for i in range(9):  # completions are the decoded valid response tokens
        valid = ro.response_ids[i][ro.response_mask[i]].tolist()
        assert ro.completions[i] == tokenizer.decode(valid, skip_special_tokens=True)
        prompt = ro.prompt_ids[i][ro.prompt_mask[i]].tolist()
        assert prompt == tokenizer(ro.prompts[i])["input_ids"]  # left-padded prompt ids


# ---------------------------------------------------------------------- rollout log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_a_forward_pass(eos_biased, forward_logprobs, temperature):
    # EOS-biased model: rows end at different steps, so padded responses are in the check.
    model, tokenizer = eos_biased(2.5)
    sampling = SamplingParams(max_new_tokens=10, temperature=temperature, seed=1)
    ro = HFEngine(model, tokenizer, progress=False).generate(
        PROMPTS, group_size=4, sampling=sampling
    )
    lengths = ro.response_mask.sum(-1)
    assert (lengths < ro.response_ids.shape[1]).any()  # some rows really ended early
    # Cached decoding vs one uncached pass differ by float32 rounding only: 4.8e-7 to 9.5e-7
    # measured (seeds 0-5, 1 and 2 threads; the logits are below 2 here, where a float32 step is
    # 1.2e-7), a tenth of the default tolerances (rtol 1.3e-6, atol 1e-5).
    torch.testing.assert_close(ro.rollout_logprobs, forward_logprobs(model, ro, temperature))


def test_logprobs_are_before_top_k_top_p(peaky, forward_logprobs):
    # The trainer's quantity is log softmax(z / T) over the whole vocabulary, whatever top-k /
    # top-p truncated for sampling (after truncation they would be larger, and 0 for top_k=1;
    # here by 0.13 to 1.1 on every sampled token).
    # In float64: the peaky model's float32 cached and uncached passes differ by up to 1.5e-5
    # (1.1e-5 at this seed on 2 threads, 7e-6 on 1), at the default tolerance's edge. In float64
    # they agree to ~1e-14 and what is left is both sides' float32 log-softmax: ≤ 7.2e-7.
    model = copy.deepcopy(peaky[0]).double()
    sampling = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=5, top_p=0.8, seed=2)
    ro = HFEngine(model, peaky[1], progress=False).generate(
        PROMPTS, group_size=2, sampling=sampling
    )
    torch.testing.assert_close(ro.rollout_logprobs, forward_logprobs(model, ro, 0.8))


def test_top_k_1_is_greedy_with_untruncated_logprobs(peaky):
    # Limit: keeping only the best token samples the argmax, whatever the seed; the log-probs
    # are still those of the full softmax at T = 1, the ones greedy decoding reports.
    eng = engine(peaky)
    greedy = eng.generate(PROMPTS, sampling=GREEDY)
    top1 = eng.generate(PROMPTS, sampling=SamplingParams(max_new_tokens=8, top_k=1, seed=5))
    same_rollouts(greedy, top1, logprobs_exact=False)
    assert (greedy.rollout_logprobs[greedy.response_mask] < 0).all()  # not the truncated 0


def test_bfloat16_model_gives_float32_logprobs(forward_logprobs):
    model, tokenizer = tiny(dtype=torch.bfloat16)
    sampling = SamplingParams(max_new_tokens=6, seed=0)
    ro = HFEngine(model, tokenizer, progress=False).generate(
        PROMPTS, group_size=2, sampling=sampling
    )
    assert ro.rollout_logprobs.dtype == torch.float32
    # bfloat16 keeps 8 significant bits (ε = 2⁻⁸ ≈ 4e-3): cached and uncached passes round
    # differently in every layer (2e-3 measured), so compare at 1e-2, not float32 tolerances.
    ref = forward_logprobs(model, ro, 1.0)
    torch.testing.assert_close(ro.rollout_logprobs, ref, atol=1e-2, rtol=0)


# ---------------------------------------------------------------------- greedy and padding
def test_greedy_equals_an_argmax_loop(peaky):
    model, tokenizer = peaky
    ro = engine(peaky).generate(PROMPTS, sampling=GREEDY)
    for i, prompt in enumerate(PROMPTS):  # slow reference: one row, no cache, full re-forward
        ids, picked, logprobs = tokenizer(prompt)["input_ids"], [], []
        for _ in range(GREEDY.max_new_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([ids + picked])).logits[0, -1].float()
            picked.append(int(logits.argmax()))
            logprobs.append(float(torch.log_softmax(logits, -1)[picked[-1]]))
            if picked[-1] == tokenizer.eos_token_id:
                break
        n = len(picked)
        assert ro.response_ids[i, :n].tolist() == picked
        assert ro.response_mask[i].tolist() == [True] * n + [False] * (8 - n)
        torch.testing.assert_close(ro.rollout_logprobs[i, :n], torch.tensor(logprobs))


def test_left_padding_matches_each_prompt_alone(peaky):
    eng = engine(peaky)
    batch = eng.generate(PROMPTS, sampling=GREEDY)
    assert not batch.prompt_mask.all()  # the prompts really were padded
    for i, prompt in enumerate(PROMPTS):
        alone = eng.generate([prompt], sampling=GREEDY).trim()
        row = batch.select([i]).trim().replace(group_ids=alone.group_ids)
        same_rollouts(row, alone, logprobs_exact=False)  # padding changes rounding only


def test_max_batch_size_chunks_like_one_batch(peaky):
    metadata = [{"i": 0}, {"i": 1}, {"i": 2}]
    whole = engine(peaky).generate(PROMPTS, group_size=3, sampling=GREEDY, metadata=metadata)
    # 9 rows in chunks of 2: groups are split across chunks, prompt widths differ per chunk.
    chunked = engine(peaky, max_batch_size=2).generate(
        PROMPTS, group_size=3, sampling=GREEDY, metadata=metadata
    )
    same_rollouts(whole, chunked, logprobs_exact=False)


# ---------------------------------------------------------------------- seeds
def test_same_seed_same_rollouts_and_global_rng_untouched(peaky):
    eng = engine(peaky)
    state = torch.get_rng_state()
    a = eng.generate(PROMPTS, group_size=2, sampling=SamplingParams(max_new_tokens=8, seed=7))
    b = eng.generate(PROMPTS, group_size=2, sampling=SamplingParams(max_new_tokens=8, seed=7))
    assert torch.equal(torch.get_rng_state(), state)
    same_rollouts(a, b)
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
    assert not torch.equal(torch.get_rng_state(), after)  # sampling advanced the global RNG


def test_engine_default_sampling_and_per_call_override(peaky):
    eng = engine(peaky, sampling=SamplingParams(max_new_tokens=3, temperature=0))
    assert eng.generate(PROMPTS).response_ids.shape[1] == 3
    assert eng.generate(PROMPTS, sampling=GREEDY).response_ids.shape[1] == 8


# ---------------------------------------------------------------------- model state
def test_checkpoint_generation_config_does_not_leak_into_sampling():
    model, tokenizer = tiny(initializer_range=0.3)
    clean = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, sampling=GREEDY)
    saved = model.generation_config
    # Settings a checkpoint could ship: each would change greedy decoding if applied.
    saved.repetition_penalty = 50.0
    saved.suppress_tokens = clean.response_ids[:, 0].tolist()
    again = HFEngine(model, tokenizer, progress=False).generate(PROMPTS, sampling=GREEDY)
    same_rollouts(clean, again, logprobs_exact=False)
    assert model.generation_config is saved and saved.repetition_penalty == 50.0  # restored


def test_train_mode_restored_and_no_grad(peaky):
    model, _ = peaky
    model.train()
    try:
        ro = engine(peaky).generate(PROMPTS, sampling=SamplingParams(max_new_tokens=2, seed=0))
        assert model.training
    finally:
        model.eval()
    engine(peaky).generate(PROMPTS, sampling=SamplingParams(max_new_tokens=2, seed=0))
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    assert not ro.rollout_logprobs.requires_grad


# ---------------------------------------------------------------------- update_weights
def test_update_weights_changes_outputs_and_records_version(peaky):
    model = copy.deepcopy(peaky[0])
    eng = HFEngine(model, peaky[1], progress=False)
    before = eng.generate(PROMPTS, sampling=GREEDY)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    eng.update_weights(perturbed.items(), version=3)
    assert eng.weights_version == 3
    assert torch.equal(model.state_dict()["model.norm.weight"], perturbed["model.norm.weight"])
    after = eng.generate(PROMPTS, sampling=GREEDY)
    assert not torch.equal(before.rollout_logprobs, after.rollout_logprobs)
    eng.update_weights(iter(original.items()), version=4)  # a generator works too
    same_rollouts(before, eng.generate(PROMPTS, sampling=GREEDY))
    assert eng.weights_version == 4


def test_update_weights_errors_name_the_weight(peaky):
    model = copy.deepcopy(peaky[0])
    eng = HFEngine(model, peaky[1], progress=False)
    with pytest.raises(ValueError, match="no weight named 'model.not_a_layer.weight'"):
        eng.update_weights([("model.not_a_layer.weight", torch.zeros(3))], version=1)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        eng.update_weights([("model.norm.weight", torch.zeros(3))], version=1)
    assert eng.weights_version == 0  # not recorded after an error


def test_update_weights_from_a_shared_model_is_a_no_op(peaky):
    # In-process sharing: engine.model is the trainer's model; syncing its own tensors changes
    # nothing, and a bf16 copy of the weights is cast back to the parameters' float32.
    model = copy.deepcopy(peaky[0])
    eng = HFEngine(model, peaky[1], progress=False)
    before = eng.generate(PROMPTS, sampling=GREEDY)
    eng.update_weights(model.named_parameters(), version=1)
    same_rollouts(before, eng.generate(PROMPTS, sampling=GREEDY))
    eng.update_weights([("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))], version=2)
    assert model.model.norm.weight.dtype == torch.float32
    assert torch.equal(model.model.norm.weight, torch.ones(64))


# ---------------------------------------------------------------------- errors and progress
def test_bad_arguments_raise_clear_errors(peaky):
    eng = engine(peaky)
    with pytest.raises(ValueError, match="group_size=0; use group_size >= 1"):
        eng.generate(PROMPTS, group_size=0)
    with pytest.raises(ValueError, match="prompts is empty"):
        eng.generate([])
    with pytest.raises(TypeError, match="wrap a single prompt in a list"):
        eng.generate("What is 2+2?")
    with pytest.raises(ValueError, match="2 metadata entries for 3 prompts"):
        eng.generate(PROMPTS, metadata=[{}, {}])
    with pytest.raises(ValueError, match="^HFEngine: max_batch_size=0; use max_batch_size >= 1"):
        HFEngine(*peaky, max_batch_size=0)


class RecordingBar:
    """Stands in for tqdm: records the total, the updates and the arguments."""

    made: ClassVar[list[RecordingBar]] = []

    def __init__(self, **kwargs):
        self.kwargs, self.total, self.n, self.updates = kwargs, kwargs["total"], 0, 0
        RecordingBar.made.append(self)

    def update(self, k: int = 1) -> None:
        self.n += k
        self.updates += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_progress_bar_counts_decoding_steps(peaky, monkeypatch):
    monkeypatch.setattr(hf_module, "tqdm", RecordingBar)
    RecordingBar.made.clear()
    engine(peaky, max_batch_size=2).generate(PROMPTS, sampling=GREEDY)  # 2 chunks × 8 steps
    bar = RecordingBar.made[-1]
    assert bar.total == 16 and bar.n == 16 and bar.kwargs["disable"] is True
    assert bar.updates == 16 + 2  # one tick per decoding step, one catch-up call per chunk
    HFEngine(*peaky).generate(PROMPTS, sampling=GREEDY)
    assert RecordingBar.made[-1].kwargs["disable"] is False
