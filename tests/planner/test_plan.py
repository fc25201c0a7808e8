"""rb.plan: the tiny model's sizes counted by hand, each part's arithmetic, the layer trace
against a real forward, the verdict and its change, and what it cannot size.

The tiny model (rlblocks.models.tiny_config): vocabulary 384, hidden 64, MLP 128, 2 layers, 2
query heads and 1 key-value head of 32, q/k/v biases, tied embeddings. Its parameters:
embedding 384·64 = 24576; per layer q 64·64+64 = 4160, k 64·32+32 = 2080, v 2080, o 64·64 =
4096, gate, up, down 3·64·128 = 24576, two norms 128: 37120; final norm 64. Total 24576 +
2·37120 + 64 = 98880.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from transformers import PretrainedConfig

import rlblocks as rb
from rlblocks.models import tiny_config, tiny_tokenizer
from rlblocks.planner import model_shape, plan
from rlblocks.rollout import HFEngine, VLLMEngine

PARAMS = 98880
MIB = 2**20


@pytest.fixture(scope="module")
def config():
    return tiny_config(tiny_tokenizer())


def test_the_tiny_model_is_sized_as_counted_by_hand(config):
    shape = model_shape(config)
    assert shape.params == shape.trainable == PARAMS
    assert shape.layer_params == 37120 and shape.layers == 2
    assert shape.vocab == 384 and shape.hidden == 64
    assert shape.kv_width == 2 * 1 * 32  # keys and values, 1 head of 32


def test_lora_trains_only_its_adapters(config):
    # r = 8 on every linear layer but the head: r·(in + out) each, per layer q 8·128, k 8·96,
    # v 8·96, o 8·128, gate 8·192, up 8·192, down 8·192 = 8192; 2 layers.
    lora = LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0)
    shape = model_shape(config, lora=lora)
    assert shape.trainable == 2 * 8192
    assert shape.params == PARAMS + 2 * 8192


def test_the_layer_trace_equals_a_real_forward(config):
    # The meta trace counts what a real layer keeps for its backward on the CPU: every saved
    # storage once, parameters left out, at 256 tokens.
    model, _ = rb.models.tiny(seed=0)
    model.train()
    layer, t = model.model.layers[0], 256
    params = {StorageWeakRef(p.untyped_storage()) for p in layer.parameters()}
    saved: dict = {}

    def keep(x):
        ref = StorageWeakRef(x.untyped_storage())
        if ref not in params:
            saved[ref] = x.untyped_storage().nbytes()
        return x

    x = torch.randn(1, t, 64, requires_grad=True)
    positions = torch.arange(t)[None]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
        rotary = model.model.rotary_emb(x, positions)
        layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    traced = model_shape(config).act_per_token[torch.float32][0]
    assert traced == sum(saved.values()) / t


def test_the_lora_trace_in_bf16_equals_a_real_forward(config):
    # peft keeps the adapters of a bf16 model in float32, so each adapted linear casts its
    # input to float32 and keeps that copy for the backward pass (an H100 run measured a LoRA
    # plan 27% low while the trace cast the adapters to bf16). The trace must count those
    # copies as a real bf16 LoRA layer keeps them.
    from peft import get_peft_model

    lora = LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0)
    model, _ = rb.models.tiny(seed=0, dtype=torch.bfloat16)
    model = get_peft_model(model, lora)
    model.train()
    layer, t = model.base_model.model.model.layers[0], 256
    assert {p.dtype for n, p in layer.named_parameters() if "lora_" in n} == {torch.float32}
    params = {StorageWeakRef(p.untyped_storage()) for p in layer.parameters()}
    saved: dict = {}

    def keep(x):
        ref = StorageWeakRef(x.untyped_storage())
        if ref not in params:
            saved[ref] = x.untyped_storage().nbytes()
        return x

    x = torch.randn(1, t, 64, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(t)[None]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
        rotary = model.base_model.model.model.rotary_emb(x, positions)
        layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    shape = model_shape(config, lora=lora, dtypes=(torch.bfloat16,))
    assert shape.act_per_token[torch.bfloat16][0] == sum(saved.values()) / t


def test_each_part_by_hand(config):
    p = plan(config, dtype="fp32", tokens=1024, engine=HFEngine, rollout_rows=64,
             rollout_tokens=1024, device_memory=None)  # fmt: skip
    assert p.trainer["weights"] == p.trainer["reference"] == p.trainer["gradients"] == 4 * PARAMS
    assert p.trainer["optimizer"] == 2 * 4 * PARAMS  # AdamW's two moments in float32
    # Five float32 chunk × vocabulary buffers (1024 × 384 × 20 bytes), the hidden states'
    # gradient (1024 × 64 × 4) and the head's float32 weight gradient (384 × 64 × 4).
    assert p.trainer["logits"] == 1024 * 384 * 20 + 1024 * 64 * 4 + 384 * 64 * 4
    # 64 rows × 1024 tokens × 2 layers × 64 × 4 bytes, and two float32 score rows per row.
    assert p.engine["kv cache"] == 64 * 1024 * 2 * 64 * 4 + 2 * 64 * 384 * 4
    assert p.engine["engine copy"] == 0  # the HF engine samples with the trainer's model
    resident = p.trainer["weights"] + p.trainer["reference"] + p.trainer["optimizer"]
    training = sum(p.trainer.values())
    assert p.peaks == {"trainer": max(training + p.engine["kv cache"],
                                      resident + p.engine["kv cache"])}  # fmt: skip


def test_activations_grow_with_tokens_and_shrink_with_checkpointing(config):
    small = plan(config, dtype="fp32", tokens=1024, engine=None).trainer["activations"]
    large = plan(config, dtype="fp32", tokens=4096, engine=None).trainer["activations"]
    kept = plan(config, dtype="fp32", tokens=4096, engine=None, gradient_checkpointing=True)
    assert large == pytest.approx(4 * small, rel=1e-6)
    assert kept.trainer["activations"] < large


def test_fsdp_shards_the_weights_and_gathers_the_root_and_two_layers(config):
    one = plan(config, dtype="fp32", engine=None)
    two = plan(config, dtype="fp32", engine=None, world=2)
    root = PARAMS - 2 * 37120  # embedding and final norm
    assert two.trainer["weights"] == 4 * PARAMS // 2 + 4 * (root + 2 * 37120)
    assert two.trainer["optimizer"] == one.trainer["optimizer"] // 2
    assert two.trainer["gradients"] == one.trainer["gradients"] // 2


def test_vllm_takes_its_share_and_sleeps_while_training(config):
    capacity = 1024 * MIB
    awake = plan(config, dtype="fp32", engine=VLLMEngine, gpu_memory_utilization=0.5,
                 device_memory=capacity)  # fmt: skip
    assert awake.engine["engine copy"] == 4 * PARAMS
    assert awake.engine["kv cache"] == capacity // 2 - 4 * PARAMS
    asleep = plan(config, dtype="fp32", engine=VLLMEngine, gpu_memory_utilization=0.5,
                  device_memory=capacity, sleep=True)  # fmt: skip
    training = sum(asleep.trainer.values())
    assert awake.peak == training + capacity // 2
    resident = sum(asleep.trainer[p] for p in ("weights", "reference", "optimizer"))
    assert asleep.peak == max(training, resident + capacity // 2)


def test_a_plan_that_does_not_fit_names_the_smallest_change_that_does(config):
    with_checkpointing = plan(config, dtype="fp32", tokens=8192, engine=None,
                              gradient_checkpointing=True)  # fmt: skip
    capacity = int(with_checkpointing.peak / 0.9) + 1
    p = plan(config, dtype="fp32", tokens=8192, engine=None, device_memory=capacity)
    assert p.fits is False
    assert p.change == "gradient_checkpointing=True"
    assert "does not fit" in str(p) and "gradient_checkpointing=True" in str(p)
    applied = plan(config, dtype="fp32", tokens=8192, engine=None, device_memory=capacity,
                   gradient_checkpointing=True)  # fmt: skip
    assert applied.fits is True


def test_a_custom_module_is_sized_as_far_as_it_can_be(config):
    class Custom(nn.Module):  # no list of decoder layers
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.config = config

    p = plan(Custom(), dtype="fp32", engine=HFEngine, device_memory=1024 * MIB)
    assert p.trainer["weights"] == 4 * (8 * 8 + 8)
    assert set(p.unsized) == {"activations"}
    assert p.fits is None
    assert "no verdict" in p.verdict() and "could not size activations" in p.verdict()
    assert "not sized" in p.table()


def test_an_unknown_architecture_names_what_it_could_not_size():
    class Unknown(PretrainedConfig):
        model_type = "rlblocks-unknown"

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 64, 2, 2
            self.vocab_size = 100

    p = plan(Unknown(), dtype="fp32", engine=HFEngine, rollout_rows=4, rollout_tokens=16)
    assert {"weights", "gradients", "optimizer", "activations"} <= set(p.unsized)
    assert "Unknown" in p.unsized["weights"]
    # The KV cache comes from the config alone: 4 rows × 16 tokens × 2 layers × (2 · 2 heads
    # of 32) × 4 bytes, and two float32 score rows of 100 per row.
    assert p.engine["kv cache"] == 4 * 16 * 2 * 128 * 4 + 2 * 4 * 100 * 4
    assert "could not size weights, reference, gradients, optimizer, activations" in p.verdict()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer": "lamb"}, "optimizer='lamb' is not sized"),
        ({"tokens": 0}, "tokens=0"),
        ({"world": 3, "tp": 2}, "world=3 ranks do not split"),
        ({"engine": "sglang"}, "engine='sglang'"),
        ({"dtype": "int8"}, "dtype='int8'"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization=nan"),
        ({"device_memory": float("nan")}, "device_memory=nan; pass the bytes of one device"),
        ({"device_memory": 0}, "device_memory=0"),
        ({"device_memory": -(2**30)}, "device_memory=-1073741824"),
        ({"lora": LoraConfig(r=4), "world": 2}, "LoRA over world=2 ranks"),
        ({"sp": 2, "tp": 2, "world": 4}, "sp=2 with tp=2 is not built"),
        ({"sp": 2, "world": 2, "gradient_checkpointing": True}, "sp=2 with gradient"),
    ],
)
def test_bad_arguments_are_refused_by_name(config, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan(config, **kwargs)


def test_a_plan_prints_as_text_and_as_markdown_in_a_notebook(config):
    p = plan(config, dtype="fp32", engine=None, device_memory=1024 * MIB)
    text, markdown = str(p), p._repr_markdown_()
    assert text.splitlines()[0] == p.headline() and text.splitlines()[-1] == p.verdict()
    # A markdown table needs blank lines around it, or the verdict becomes one of its rows.
    assert markdown == f"{p.headline()}\n\n{p.table()}\n\n{p.verdict()}"
    assert p.table().count("\n") == 1 + len(p.trainer) + len(p.engine) + len(p.peaks)


def test_bf16_autocast_keeps_float32_state_and_bf16_activations():
    # PolicyTrainer on a GPU: float32 weights, gradients and AdamW moments, bf16 activations.
    # So its plan is the float32 plan's state beside the bf16 plan's activations.
    common = {"tokens": 2048, "engine": None, "device_memory": 2**34}
    fp32 = rb.plan("smollm2-135m", dtype="fp32", **common)
    bf16 = rb.plan("smollm2-135m", dtype="bf16", **common)
    mixed = rb.plan("smollm2-135m", dtype="fp32", autocast=True, **common)
    for part in ("weights", "reference", "gradients", "optimizer"):
        assert mixed.trainer[part] == fp32.trainer[part]
    assert mixed.trainer["activations"] == bf16.trainer["activations"]
    assert mixed.trainer["logits"] == bf16.trainer["logits"] < fp32.trainer["logits"]
    assert "with bf16 autocast" in mixed.headline()
