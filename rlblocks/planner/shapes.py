"""What the planner knows of a model without its weights: sizes read off a meta-device copy.

:func:`model_shape` builds the model from its config on the ``meta`` device (accelerate's
``init_empty_weights``: shapes, no storage, no weights read), optionally wraps it in peft's LoRA
the way ``PolicyTrainer`` does, and reads:

- the parameters, total and trainable, and those of the largest decoder layer (accelerate's
  ``compute_module_sizes`` per module);
- the activation bytes a decoder layer keeps for its backward pass, per token: one layer is run
  forward on meta tensors of 256 tokens under ``torch.autograd.graph.saved_tensors_hooks``,
  summing each saved storage once and leaving the parameters out. That is the implementation's
  own count (its attention kernel, its norms, LoRA's extra inputs), not a formula per family;
  the tensors whose last dimension is the hidden size are also counted apart (the replicated
  share under tensor parallelism);
- the key-value width, vocabulary, hidden size and layer count from the config.

A part it cannot size is named in :attr:`ModelShape.unsized` with the reason, and its bytes are
left at 0: the caller reports the bytes it could size and what it could not.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

WEIGHT_PARTS = ("weights", "reference", "gradients", "optimizer", "activations")
"""The parts that need the model built (its parameters, its layers)."""
TRACE_TOKENS = 256
"""Tokens of the meta forward that counts a layer's saved activations (per-token bytes are
linear in the tokens for the kernels traced; attention that keeps ``t × t`` scores is not, and
is read per token at this length)."""


@dataclass(frozen=True)
class ModelShape:
    """Sizes of one model (and its LoRA adapters) read without its weights."""

    name: str
    params: int
    """Every parameter, once (tied weights once)."""
    trainable: int
    """What the optimizer holds: all parameters, or the LoRA adapters."""
    layer_params: int
    """The largest decoder layer's parameters (FSDP gathers about one at a time)."""
    layers: int
    hidden: int
    vocab: int
    kv_width: int
    """Key + value width per token and layer: 2 × key-value heads × head dimension."""
    act_per_token: dict[torch.dtype, tuple[float, float, float]] = field(default_factory=dict)
    """dtype -> (bytes a layer saves per token, the share of it with the hidden size as last
    dimension, its largest saved tensor's), from the meta trace."""
    unsized: dict[str, str] = field(default_factory=dict)
    """part -> why it could not be sized."""


def load_config(model: Any) -> Any:
    """The ``transformers`` config of ``model``: a config, a module with ``.config``, a folder
    or a built-in name (rlblocks.models.BUILTINS; read from its file, no weights loaded)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(
                f"plan: the module {type(model).__name__} has no .config; pass its "
                "transformers config (or the folder it was saved in)"
            )
        return config
    if not isinstance(model, (str, Path)):
        raise TypeError(
            f"plan: model={model!r}; pass a transformers config, a model, a folder or a built-in "
            "name"
        )
    from rlblocks.models.builtin import BUILTINS, GGUFModel, TinyModel, cache_dir

    name = str(model)
    if name in BUILTINS:
        spec = BUILTINS[name]
        converted = cache_dir() / name / "config.json"
        if converted.exists():
            return AutoConfig.from_pretrained(converted.parent)
        if isinstance(spec, TinyModel):
            from rlblocks.models.tiny import tiny_config, tiny_tokenizer

            return tiny_config(tiny_tokenizer(), **spec.overrides)
        if isinstance(spec, GGUFModel):
            gguf = spec.locate()
            return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoConfig.from_pretrained(name)


def model_shape(
    model: Any, *, lora: Any = None, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> ModelShape:
    """:class:`ModelShape` of ``model`` (:func:`load_config`'s forms), with ``lora`` (a
    ``peft.LoraConfig``) wrapped as ``PolicyTrainer`` wraps it; the layer trace runs once per
    dtype of ``dtypes``."""
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoModelForCausalLM

    config = load_config(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = (
        str(model)
        if isinstance(model, (str, Path))
        else (getattr(config, "_name_or_path", "") or type(config).__name__)
    )
    unsized: dict[str, str] = {}
    if isinstance(model, nn.Module):
        meta = model  # its own parameters; a layer is copied to the meta device to trace it
    else:
        try:
            with init_empty_weights():
                meta = AutoModelForCausalLM.from_config(config)
            meta.tie_weights()  # built on meta, tied weights are two until tied again
        except Exception as error:  # noqa: BLE001 - reported by part, the rest still sized
            meta = None
            why = (
                f"transformers cannot build {type(config).__name__} "
                f"({type(error).__name__}: {str(error).splitlines()[0][:160]}); pass the model "
                "itself"
            )
            unsized.update({part: why for part in WEIGHT_PARTS})
    if meta is not None and lora is not None:
        from peft import get_peft_model

        meta = get_peft_model(copy.deepcopy(meta) if meta is model else meta, lora)
    params = sum(p.numel() for p in meta.parameters()) if meta is not None else 0
    trainable = (
        sum(p.numel() for p in meta.parameters() if p.requires_grad) if meta is not None else 0
    )
    layers = decoder_layers(meta) if meta is not None else None
    if meta is not None and layers is None:
        unsized["activations"] = (
            f"no list of decoder layers found in {type(meta).__name__} (looked for the longest "
            "nn.ModuleList of one module class)"
        )
    if layers is None:
        layer_params, n_layers = 0, int(getattr(text, "num_hidden_layers", 0) or 0)
    else:
        sizes = compute_module_sizes(layers, dtype=torch.float32)
        layer_params = max(sizes[str(i)] for i in range(len(layers))) // 4
        n_layers = len(layers)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    head_dim = int(getattr(text, "head_dim", 0) or (hidden // heads if heads else 0))
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
    if not head_dim or not kv_heads:
        unsized["kv cache"] = f"{type(text).__name__} names no attention heads or head size"
    acts: dict[torch.dtype, tuple[float, float, float]] = {}
    if layers is not None:
        assert meta is not None  # the layers were found in it
        for dtype in dtypes:
            try:
                acts[dtype] = _saved_per_token(meta, layers[0], hidden, dtype)
            except Exception as error:  # noqa: BLE001 - reported by part
                unsized["activations"] = (
                    f"a {type(layers[0]).__name__} forward on the meta device failed "
                    f"({type(error).__name__}: {str(error)[:200]})"
                )
                break
    return ModelShape(
        name=name,
        params=params,
        trainable=trainable,
        layer_params=layer_params,
        layers=n_layers,
        hidden=hidden,
        vocab=int(getattr(text, "vocab_size", 0) or 0),
        kv_width=2 * kv_heads * head_dim,
        act_per_token=acts,
        unsized=unsized,
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The longest ``nn.ModuleList`` whose modules are all of one class (a decoder stack)."""
    best = None
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > 0
            and len({type(m) for m in module}) == 1
            and (best is None or len(module) > len(best))
        ):
            best = module
    return best


def _saved_per_token(
    model: nn.Module, layer: nn.Module, hidden: int, dtype: torch.dtype
) -> tuple[float, float, float]:
    """(bytes, hidden-width bytes, largest tensor's bytes) one decoder layer saves for
    backward, per token."""
    from torch.multiprocessing.reductions import StorageWeakRef

    if any(p.device.type != "meta" for p in layer.parameters()):
        layer = copy.deepcopy(layer).to("meta")  # a real model's layer: traced on a copy
    layer = layer.to(dtype)
    _upcast_adapters(layer)
    params = {StorageWeakRef(p.untyped_storage()) for p in layer.parameters()}
    saved: dict[Any, tuple[int, bool]] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in params and ref not in saved:
            saved[ref] = (t.untyped_storage().nbytes(), t.shape[-1:] == (hidden,))
        return t

    t = TRACE_TOKENS
    x = torch.zeros(1, t, hidden, dtype=dtype, device="meta", requires_grad=True)
    positions = torch.arange(t, device="meta")[None]
    kwargs: dict[str, Any] = {"attention_mask": None, "position_ids": positions}
    rotary = _rotary(model)
    if rotary is not None:
        rotary = copy.deepcopy(rotary).to("meta")
        kwargs["position_embeddings"] = tuple(e.to(dtype) for e in rotary(x, positions))
    with (
        torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t),
        _train(layer),
        _flash_like(layer),
    ):
        layer(x, **kwargs)
    total = sum(n for n, _ in saved.values())
    wide = sum(n for n, is_hidden in saved.values() if is_hidden)
    largest = max((n for n, _ in saved.values()), default=0)
    return total / t, wide / t, largest / t


def _upcast_adapters(layer: nn.Module) -> None:
    """LoRA adapters in float32 over a bfloat16 or float16 layer, as ``get_peft_model`` leaves
    them (its ``autocast_adapter_dtype``): each adapted linear then casts its input to float32
    and keeps that copy for the backward pass, which the trace must see (on an H100, a
    Qwen2.5-0.5B-shaped LoRA r16 run in bf16 measured 27% above a trace that cast the adapters
    to bf16)."""
    if "peft" not in sys.modules:
        return
    from peft.tuners.tuners_utils import BaseTunerLayer, cast_adapter_dtype

    names = {
        name
        for module in layer.modules()
        if isinstance(module, BaseTunerLayer)
        for name in module.active_adapters
    }
    for name in names:
        cast_adapter_dtype(layer, adapter_name=name)


PLAN_ATTENTION = "rlblocks_plan"
"""The attention the trace runs: what a flash-type kernel keeps (below)."""


class _FlashLike(torch.autograd.Function):
    """Shapes only: keeps what flash attention (sdpa's flash and cuDNN kernels, the CPU flash
    kernel, flash-attn) keeps for its backward: queries, keys, values, the output and one
    float32 log-sum-exp per query and head; never the ``t × t`` scores, which the meta
    device's sdpa (its math form) would keep."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the trace has no backward
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _plan_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention signature: ``(b h t d)`` in, ``(b t h d)`` out."""
    return _FlashLike.apply(query, key, value).transpose(1, 2), None


@contextlib.contextmanager
def _flash_like(model: nn.Module):
    """``model``'s attention as :class:`_FlashLike` while the block runs."""
    from transformers import AttentionInterface

    from rlblocks.models.packing import attention_implementation

    AttentionInterface.register(PLAN_ATTENTION, _plan_attention)
    with attention_implementation(model, PLAN_ATTENTION):
        yield


def _rotary(model: nn.Module) -> nn.Module | None:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module
    return None


@contextlib.contextmanager
def _train(layer: nn.Module):
    was = layer.training
    layer.train()
    try:
        yield
    finally:
        layer.train(was)
