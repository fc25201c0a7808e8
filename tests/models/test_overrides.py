"""Overrides of a checkpoint's configuration at load time (attention implementation, RoPE
scaling, any config key) and the reference model's dtype, on the tiny model: each takes effect
where it can, and is refused, naming the key and the model, where it cannot."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, GPT2Config

import rlblocks as rb
from rlblocks.models import load
from rlblocks.trainer import PolicyTrainer


def rows(tokenizer, n: int = 3) -> rb.Rollouts:
    """A few rows of real text (prompt and response) to score."""
    prompts = [tokenizer.encode("What is 12 + 7?")] * n
    responses = [tokenizer.encode(t) for t in ("19", "It is 19.", "twenty")][:n]
    return rb.Rollouts.from_lists(prompts, responses, pad_token_id=tokenizer.pad_token_id)


def test_the_attention_implementation_is_chosen_and_an_unusable_one_is_refused():
    eager, tokenizer = load("tiny", attn_implementation="eager")
    sdpa, _ = load("tiny", attn_implementation="sdpa")
    assert eager.config._attn_implementation == "eager"
    assert sdpa.config._attn_implementation == "sdpa"
    # The same weights: the two kernels agree to float32 rounding (torch's own float32
    # tolerances: the sums differ only in order).
    batch = rows(tokenizer)
    scores = [PolicyTrainer(m, reference=None).logprobs(batch) for m in (eager, sdpa)]
    torch.testing.assert_close(scores[0], scores[1])
    for name, why in (("flash_attention_2", "FlashAttention2"), ("bogus", "not supported")):
        with pytest.raises(
            ValueError, match=rf"attn_implementation='{name}' cannot load 'tiny'.*{why}"
        ):
            load("tiny", attn_implementation=name)


def test_rope_scaling_divides_the_rotary_frequencies_and_is_refused_where_it_cannot_apply(
    tmp_path,
):
    plain, _ = load("tiny")
    linear, _ = load("tiny", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert linear.config.rope_parameters["rope_type"] == "linear"
    assert linear.config.rope_parameters["rope_theta"] == plain.config.rope_parameters["rope_theta"]
    # Linear (position-interpolation) scaling: position p is rotated as p / factor would be,
    # i.e. every inverse frequency divided by the factor.
    torch.testing.assert_close(
        linear.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq / 2.0, rtol=0, atol=0
    )
    for scaling, message in (
        ({"rope_type": "bogus"}, "rope_type 'bogus' is unknown to transformers"),
        ({"rope_type": "linear"}, "Missing required keys .* {'factor'}"),
        ({"rope_type": "linear", "factor": 0.5}, "factor must be a number >= 1, got 0.5"),
    ):
        with pytest.raises(ValueError, match=message):
            load("tiny", rope_scaling=scaling)
    # A model without rotary embeddings (GPT-2's learned positions): refused, not ignored.
    folder = tmp_path / "gpt2"
    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=len(rb.models.tiny_tokenizer()))
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    rb.models.tiny_tokenizer().save_pretrained(folder)
    assert load(folder)[0].config.model_type == "gpt2"  # it loads without the override
    with pytest.raises(ValueError, match=r"'.*gpt2' \(GPT2Config\) has no rotary position"):
        load(folder, rope_scaling={"rope_type": "linear", "factor": 2.0})


def test_any_config_key_is_set_and_an_unknown_one_is_refused_with_the_closest_names():
    model, _ = load("tiny", model_config={"max_position_embeddings": 1024, "use_cache": False})
    assert model.config.max_position_embeddings == 1024 and model.config.use_cache is False
    with pytest.raises(
        ValueError,
        match=r"'max_position_embedding' is not a setting of 'tiny' \(Qwen2Config\) \(did you "
        r"mean max_position_embeddings",
    ):
        load("tiny", model_config={"max_position_embedding": 1024})
    with pytest.raises(ValueError, match="pass it as rope_scaling=, which checks it"):
        load("tiny", model_config={"rope_parameters": {"rope_type": "linear"}})


def test_the_overrides_pass_through_from_pretrained_and_placement_build():
    with rb.placement.Local() as placement:
        policy = placement.build(
            "actor",
            PolicyTrainer.from_pretrained,
            "tiny",
            device="cpu",
            attn_implementation="eager",
            model_config={"max_position_embeddings": 1024},
            lr=1e-4,  # and the trainer's own keywords still reach it
        )
        engine = placement.build(
            "rollout",
            rb.rollout.HFEngine.from_pretrained,
            "tiny",
            device="cpu",
            dtype=torch.bfloat16,  # the engine's dtype, apart from the trainer's
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        )
    assert policy.model.config._attn_implementation == "eager" and policy.config.lr == 1e-4
    assert policy.model.config.max_position_embeddings == 1024
    assert next(policy.model.parameters()).dtype == torch.float32
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert engine.model.config.rope_parameters["factor"] == 2.0


def test_the_reference_keeps_its_own_dtype():
    model, tokenizer = load("tiny")
    policy = PolicyTrainer(copy.deepcopy(model), reference_dtype=torch.bfloat16)
    assert {p.dtype for p in policy.reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    # Its log-probs are those of the bfloat16 copy itself, scored as any reference is.
    by_hand = PolicyTrainer(copy.deepcopy(model), reference=copy.deepcopy(model).to(torch.bfloat16))
    batch = rows(tokenizer)
    torch.testing.assert_close(
        policy.ref_logprobs(batch), by_hand.ref_logprobs(batch), rtol=0, atol=0
    )
    assert not torch.equal(policy.ref_logprobs(batch), policy.logprobs(batch))  # bf16 vs f32
    with pytest.raises(ValueError, match="reference_dtype=torch.bfloat16 needs a reference module"):
        PolicyTrainer(copy.deepcopy(model), reference=None, reference_dtype=torch.bfloat16)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="LoRA: its reference is the policy's own base weights"):
        PolicyTrainer(copy.deepcopy(model), lora=lora, reference_dtype=torch.bfloat16)


def test_the_critic_takes_the_same_overrides():
    critic = rb.critic.CriticTrainer.from_pretrained(
        "tiny", device="cpu", attn_implementation="eager", model_config={"use_cache": False}
    )
    config = critic.model.backbone.config
    assert config._attn_implementation == "eager" and config.use_cache is False
    with pytest.raises(ValueError, match="'tiny' \\(Qwen2Config\\) \\(did you mean use_cache"):
        rb.critic.CriticTrainer.from_pretrained("tiny", device="cpu", model_config={"use_cach": 1})
