"""LoRA through peft: what is trained, the adapter-disabled reference, merged weights."""

from __future__ import annotations

import pytest
import torch
from builders import tiny_trainer
from peft import LoraConfig
from torch.testing import assert_close

from rlblocks.losses import clipped_surrogate
from rlblocks.models import tiny
from rlblocks.trainer.forward import response_logits
from rlblocks.trainer.lora import merged_weights

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _lora(**kw) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, **kw)


def test_only_adapters_train_and_reference_is_the_base_model(make_rollouts):
    ro = make_rollouts(seed=0)
    base_lp = tiny_trainer(lr=1e-6).logprobs(ro)
    model = tiny()[0]
    base_weight = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    trainer = tiny_trainer(module=model, reference="auto", lora=_lora(), lr=1e-2)
    assert trainer.reference is None  # no copy: the reference is the adapter-disabled model
    trained = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    names = [n for n, p in trainer.model.named_parameters() if id(p) in trained]
    assert names and all(".lora_" in n for n in names)
    # B = 0 at initialisation: policy, reference and base model all agree.
    assert_close(trainer.ref_logprobs(ro), base_lp)
    assert_close(trainer.logprobs(ro), base_lp)
    for _ in range(2):
        trainer.step(ro, torch.randn(8), loss_fn=clipped_surrogate)
    assert_close(trainer.ref_logprobs(ro), base_lp)  # the reference did not move
    assert (trainer.logprobs(ro) - base_lp).abs().max() > 1e-3  # the policy did
    q_proj = trainer.model.get_base_model().model.layers[0].self_attn.q_proj
    assert torch.equal(q_proj.base_layer.weight, base_weight)  # the base is frozen
    assert set(trainer.state_dict()["model"]) == set(names)  # only adapters are saved


def test_merged_weights_reproduce_the_peft_model(make_rollouts):
    ro = make_rollouts(seed=1)
    # init_lora_weights=False: random B, so the merge is not trivially W (then train a step).
    lora = _lora(init_lora_weights=False)
    trainer = tiny_trainer(torch.float64, reference="auto", lora=lora, lr=1e-2)
    trainer.step(ro, torch.randn(8), loss_fn=clipped_surrogate)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    weights = dict(trainer.named_weights())

    plain = tiny(dtype=torch.float64, seed=5)[0]  # other random weights, all overwritten
    assert weights.keys() == plain.state_dict().keys()  # HF names, nothing else
    plain.load_state_dict(weights, strict=True)
    with torch.no_grad():
        expected = response_logits(trainer.model, ro)
        got = response_logits(plain, ro)
    assert_close(got, expected)  # float64: W' x vs W x + s·B(A x) agree to ~1e-15
    q_proj = trainer.model.get_base_model().model.layers[0].self_attn.q_proj
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[name], q_proj.base_layer.weight)  # the delta is in
    for n, p in trainer.model.named_parameters():  # and the model was not touched
        assert torch.equal(p, before[n]), n


def test_merged_weights_loop_reference():
    trainer = tiny_trainer(reference="auto", lora=_lora(init_lora_weights=False), lr=1e-6)
    weights = dict(merged_weights(trainer.model))
    layers = trainer.model.get_base_model().model.layers
    for i, layer in enumerate(layers):
        for path in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"):
            module = layer.get_submodule(path)
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight
            scaling = 8 / 4  # lora_alpha / r
            expected = module.base_layer.weight + scaling * (b @ a)  # W + (α/r)·B·A
            assert_close(weights[f"model.layers.{i}.{path}.weight"], expected.detach())


def test_dora_is_refused():
    with pytest.raises(NotImplementedError, match="DoRA"):
        tiny_trainer(reference="auto", lora=_lora(use_dora=True), lr=1e-6)


def test_lora_with_gradient_checkpointing_updates_adapters(make_rollouts):
    ro = make_rollouts(seed=2)
    lora = _lora()
    trainer = tiny_trainer(reference="auto", lora=lora, lr=1e-2, gradient_checkpointing=True)
    lora_b = trainer.model.get_base_model().model.layers[0].self_attn.q_proj.lora_B["default"]
    assert torch.all(lora_b.weight == 0)
    out = trainer.step(ro, torch.randn(8), loss_fn=clipped_surrogate)
    assert out["optimizer_steps"] == 1 and lora_b.weight.abs().max() > 0
