"""A sync is all or nothing: the whole transfer is checked before the first weight is written.

Trainer: the tiny 2-layer model (seed 0). Engines: tiny models of another seed, so a weight
the sync wrote differs from the snapshot taken before it.
"""

import copy
import re

import pytest
import torch
from builders import tiny_trainer

import rlblocks as rb
from rlblocks.interfaces import TensorSpec
from rlblocks.resharder import Resharder
from rlblocks.resharder.strict import check_tokenizers
from rlblocks.rollout.vllm import hf_weight_spec


def make_engine(tokenizer=None, dtype=torch.float32, **config):
    model, own = rb.models.tiny(seed=1, dtype=dtype, **config)
    return rb.rollout.HFEngine(model, tokenizer or own, progress=False)


def snapshot(engine):
    return {name: t.clone() for name, t in engine.model.state_dict().items()}


def assert_untouched(engine, before):
    after = engine.model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert engine.weights_version == 0


def refused(policy, engine, match: str) -> str:
    """Sync in ~10 KB buckets (the old code wrote several before failing); the error text."""
    before = snapshot(engine)
    with pytest.raises(ValueError) as error:
        Resharder(bucket_mb=0.01).sync(policy, engine)
    assert_untouched(engine, before)
    assert re.search(match, str(error.value)), error.value
    return str(error.value)


def test_a_larger_engine_is_refused_before_any_write():
    # Each Qwen2 layer holds 12 tensors (q, k, v weights and biases, o, gate, up, down, two
    # norms): layer 2 of the 3-layer engine is 12 weights the trainer does not send. Before the
    # check this sync reported success and left layer 2 random.
    message = refused(tiny_trainer(), make_engine(num_hidden_layers=3), "12 missing")
    assert message == (
        "Resharder: the trainer's weights do not fit the engine, nothing was copied "
        "(12 missing from the trainer):\n"
        "  model.layers.2.self_attn.q_proj.weight (missing): trainer: none, "
        "engine: (64, 64) float32\n"
        "  model.layers.2.self_attn.q_proj.bias (missing): trainer: none, engine: (64,) float32\n"
        "  model.layers.2.self_attn.k_proj.weight (missing): trainer: none, "
        "engine: (32, 64) float32\n"
        "  ... and 9 more"
    )


def test_a_smaller_engine_is_refused_with_layer_0_untouched():
    # Before the check, layer 0 was overwritten and the sync failed at layer 1.
    message = refused(tiny_trainer(), make_engine(num_hidden_layers=1), "12 unknown to the engine")
    assert (
        "  model.layers.1.self_attn.q_proj.weight (extra): trainer: (64, 64) float32, " in message
    )
    assert message.endswith("... and 9 more")


def test_another_shape_is_refused():
    # intermediate_size 96 instead of 128: gate, up and down projections of both layers.
    message = refused(tiny_trainer(), make_engine(intermediate_size=96), "6 of another shape")
    assert (
        "model.layers.0.mlp.gate_proj.weight (shape): trainer: (128, 64) float32, "
        "engine: (96, 64) float32" in message
    )


def test_a_float_cast_is_allowed():
    # float32 trainer -> bfloat16 engine: the engine rounds what it loads (its own precision).
    policy, engine = tiny_trainer(), make_engine(dtype=torch.bfloat16)
    metrics = Resharder().sync(policy, engine)
    assert metrics["sync/version"] == engine.weights_version == 1
    held = engine.model.state_dict()
    for name, value in policy.named_weights():
        assert torch.equal(held[name], value.to(torch.bfloat16)), name


def test_a_float_into_an_integer_tensor_is_refused():
    # A persistent integer buffer (a step counter) where the trainer holds a float one: not a
    # precision but another tensor.
    policy, engine = tiny_trainer(), make_engine()
    policy.model.register_buffer("counter", torch.zeros(3))
    engine.model.register_buffer("counter", torch.zeros(3, dtype=torch.int64))
    message = refused(policy, engine, "1 of a dtype the engine cannot cast to")
    assert "  counter (dtype): trainer: (3,) float32, engine: (3,) int64" in message


def test_another_vocabulary_is_refused():
    # A tokenizer trained to 380 tokens: the weights fit (the model is the same size), the
    # ids do not mean the same text. Its first 380 merges are the 384-token one's.
    other = rb.models.tiny_tokenizer(vocab_size=380)
    message = refused(tiny_trainer(), make_engine(tokenizer=other), "different tokenizers")
    assert "vocabulary: trainer 384 tokens, sha256 " in message
    assert ", engine 380 tokens, sha256 " in message
    assert "is 380 for the trainer, None for the engine" in message


def test_another_eos_id_is_refused():
    _, tokenizer = rb.models.tiny()
    other = copy.deepcopy(tokenizer)
    other.eos_token = "<|im_start|>"  # id 1; the trainer's <|im_end|> is 2
    message = refused(tiny_trainer(), make_engine(tokenizer=other), "different tokenizers")
    assert message.endswith("eos_token_id: trainer 2, engine 1")


def test_a_tokenizer_without_padding_matches_one_with():
    # Padding is masked out; an engine gives a tokenizer without one its EOS (models.load).
    _, tokenizer = rb.models.tiny()
    plain = copy.deepcopy(tokenizer)
    plain.pad_token = None
    check_tokenizers(plain, tokenizer)
    other = copy.deepcopy(tokenizer)
    other.pad_token = "<|im_start|>"
    with pytest.raises(ValueError, match="pad_token_id: trainer 0, engine 1"):
        check_tokenizers(tokenizer, other)


def test_the_trainer_declares_what_it_sends():
    # weight_spec (metadata) against named_weights (the tensors), names in the same order.
    # Plain, then LoRA (W + BA under the base names), which a plain engine takes as it is.
    from peft import LoraConfig

    policy = tiny_trainer()
    sent = {name: TensorSpec.of(t) for name, t in policy.named_weights()}
    assert list(policy.weight_spec().items()) == list(sent.items())
    lora = tiny_trainer(lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    sent = {name: TensorSpec.of(t) for name, t in lora.named_weights()}
    assert list(lora.weight_spec().items()) == list(sent.items())
    assert lora.weight_spec() == policy.weight_spec()
    engine = make_engine()
    Resharder().sync(lora, engine)
    held = engine.model.state_dict()
    assert all(torch.equal(held[name], t) for name, t in lora.named_weights())


def test_a_shared_lora_module_needs_no_check():
    # HFEngine(policy.model) of a LoRA policy holds peft's names: nothing moves, nothing to check.
    from peft import LoraConfig

    policy = tiny_trainer(lora=LoraConfig(r=4, target_modules=["q_proj"]))
    engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, progress=False)
    assert Resharder().sync(policy, engine)["sync/bytes"] == 0.0


def test_the_vllm_spec_is_the_hf_engines():
    # VLLMEngine declares the state_dict of the transformers model its config describes: for
    # the tiny model, exactly what an HFEngine on it holds (tied lm_head included).
    model, _ = rb.models.tiny()
    expected = rb.rollout.HFEngine(model, None, progress=False).weight_spec()
    assert hf_weight_spec(model.config, torch.float32) == expected
    halves = hf_weight_spec(model.config, torch.bfloat16)
    assert {spec.dtype for spec in halves.values()} == {torch.bfloat16}


def test_a_sharded_trainer_is_checked_without_gathering(tmp_path):
    # Two FSDP2 ranks: weight_spec from the DTensors' global shapes equals what named_weights
    # gathers; a 3-layer engine is refused on every rank before any collective (a rank that
    # went on alone would hang) and untouched; a 2-layer engine then syncs exactly.
    from dp_cases import run

    result = run("strict_sync_sharded", str(tmp_path / "out.pt"))
    assert result["spec_is_gathered"] and result["untouched"] and result["synced"]
    assert result["error"].endswith("... and 9 more")
    assert "(12 missing from the trainer)" in result["error"]
