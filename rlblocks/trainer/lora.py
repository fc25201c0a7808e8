"""LoRA through peft: wrapping a model, and its merged weights under the base model's names.

The rollout engine serves a plain Hugging Face model, so after a LoRA update the resharder needs
the *merged* weights, W' = W + Δ with Δ = (α / r) · B·A (Hu et al. 2021, "LoRA", arXiv
2106.09685, eq. 3 and sec. 4.1: "W = W0 + BA" can be merged for inference), under the base
model's parameter names (``model.layers.0.self_attn.q_proj.weight``, not peft's
``base_model.model.….base_layer.weight``).

:func:`merged_weights` computes W + Δ into new tensors with peft's ``get_delta_weight`` and
never mutates the model: peft's ``merge_adapter`` / ``unmerge_adapter`` would add Δ to W in
place and subtract it again, which is not exact in floating point and would slowly drift the
frozen base weights. DoRA and ``modules_to_save`` are not supported (an error says so).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rlblocks.trainer.fsdp import full_tensor

if TYPE_CHECKING:
    from peft import LoraConfig


def is_peft_model(model: nn.Module) -> bool:
    """True when ``model`` is a peft ``PeftModel`` (cheap: peft is not imported if unused)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def wrap_lora(model: nn.Module, config: LoraConfig) -> nn.Module:
    """``peft.get_peft_model(model, config)``: adapters added, every base parameter frozen.

    The model passed in is modified (peft injects the adapter layers into it); use the
    returned wrapper. DoRA (``use_dora=True``) is refused because :func:`merged_weights` cannot
    merge it without mutating the model.
    """
    from peft import get_peft_model

    if getattr(config, "use_dora", False):
        raise NotImplementedError(
            "PolicyTrainer: LoraConfig(use_dora=True) asks for DoRA, which is not supported; "
            "use plain LoRA (use_dora=False)"
        )
    if getattr(config, "modules_to_save", None):
        raise NotImplementedError(
            f"PolicyTrainer: LoraConfig.modules_to_save={config.modules_to_save!r} is not "
            "supported; leave it None (only the adapter trains)"
        )
    return get_peft_model(model, config)


@torch.no_grad()
def merged_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The weights of the base model with the active LoRA adapters merged in, with HF names.

    For each LoRA-wrapped layer: W' = W + Σ_a scaling_a · B_a A_a over the active adapters a
    (nothing is added when the adapter is already merged into W). Every other entry of the base
    model's ``state_dict`` is yielded as it is (shared storage, no copy); adapter parameters are
    not yielded. The keys are exactly those of the unwrapped model's ``state_dict()``, so
    ``plain_model.load_state_dict(dict(merged_weights(peft_model)))`` works with ``strict=True``.

    Shapes: each tensor has its parameter's shape and dtype; all are detached (no grad).
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
    merged: dict[str, Tensor] = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if any(getattr(module, "use_dora", {}).get(a, False) for a in module.active_adapters):
            raise NotImplementedError(
                f"merged_weights: {name} is a DoRA adapter, which cannot be merged here; use plain LoRA"
            )
        weight: Tensor = module.get_base_layer().weight  # type: ignore[assignment]  # Module.__getattr__ is typed Tensor | Module
        merged[f"{name}.weight"] = with_adapters(module, weight)
    for key, tensor in base_weights(model):
        yield key, merged.get(key, tensor)


def with_adapters(module: Any, weight: Tensor) -> Tensor:
    """``weight``, the whole base weight of the LoRA layer ``module``, plus scaling · B·A of
    each of its active adapters (peft's ``get_delta_weight``; made whole when the adapters are
    FSDP shards, a collective then); as it is when the adapters are merged into it already."""
    if module.merged:
        return weight
    for adapter in module.active_adapters:
        if adapter in module.lora_A or adapter in module.lora_embedding_A:
            delta = full_tensor(module.get_delta_weight(adapter))
            weight = weight + delta.to(weight.dtype)
    return weight


def check_mergeable(model: nn.Module) -> None:
    """Refuse, naming the layer, a LoRA adapter on a weight the model ties to another (the
    embedding and ``lm_head`` under ``tie_word_embeddings``): merged, the two names would need
    two tensors where the engine's model has one, and an engine given them samples from
    another model than the policy's (measured: log-probs 0.4 apart after two syncs). A
    policy whose engine shares its model needs no merge and trains such an adapter fine."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
    output = base.get_output_embeddings()
    shared = base.get_input_embeddings().weight
    if output is None or output.weight is not shared:
        return
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and module.get_base_layer().weight is shared:
            raise ValueError(
                f"PolicyTrainer: the LoRA adapter on {name} cannot be merged: its weight is tied "
                "to the other end of the model (tie_word_embeddings), so the engine's model has "
                "one tensor for two different values; leave lm_head and embed_tokens out of "
                "target_modules, or sample with the policy's own model (an engine that shares "
                "it needs no merge)"
            )


def base_weights(model: nn.Module, *, keep_vars: bool = False) -> Iterator[tuple[str, Tensor]]:
    """The base model's ``state_dict`` under Hugging Face names, adapters left out: the names,
    shapes and dtypes :func:`merged_weights` yields, the base values (nothing merged)."""
    base = model.get_base_model()  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
    for key, tensor in base.state_dict(keep_vars=keep_vars).items():
        if ".lora_" in key:  # lora_A / lora_B / lora_embedding_A / lora_embedding_B
            continue
        yield key.replace(".base_layer.", "."), tensor
