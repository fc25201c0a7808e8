"""Tensor parallelism for the trainers: a model's layers split over the ranks of a mesh dimension.

Megatron's tensor parallelism, built with torch's DTensor (``parallelize_module``), as
torchtitan does. Within a decoder layer the q/k/v and gate/up projections are split by output
columns (``ColwiseParallel``: each rank computes ``heads / tp`` attention heads and
``intermediate / tp`` MLP features) and o/down by input rows (``RowwiseParallel``: each rank's
partial sum is all-reduced), so a layer costs two all-reduces forward and two backward, and
each rank holds about ``1 / tp`` of the layer's weights. The token embedding is split by
vocabulary rows; the output layer too, and its log-probs are computed vocabulary-parallel
(``rlblocks.losses.vocab_parallel_token_scores``: no rank ever holds ``(b t v)`` logits).

**The plan** is the model's own: the ``tp_plan`` transformers ships with each model class
(``"colwise"``, ``"rowwise"``, …; Llama, Qwen2, Mistral and most others have one), translated
to torch's parallel styles here. A model of the Llama/Qwen2 family without one gets
:data:`LLAMA_PLAN`, rlblocks' own. Anything else is refused before any compute, as is a
layout the model's sizes cannot take (heads, key-value heads, MLP features or vocabulary not
divisible by ``tp``).

Norms and biases outside the plan stay whole on every rank of a tensor-parallel group: their
inputs and output gradients are the same on every rank (the all-reduces make them so), so
their gradients are too, and nothing needs summing over the group.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

#: rlblocks' plan for the Llama/Qwen2 family (the names inside a ``*ForCausalLM``), used when a
#: model ships none; the styles are transformers' names (:data:`STYLES`).
LLAMA_PLAN: dict[str, str] = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}

#: Model types that :data:`LLAMA_PLAN` fits (same module names and shapes).
LLAMA_FAMILY = frozenset({"llama", "qwen2", "mistral"})

#: The transformers plan styles rlblocks translates (others are refused, naming them).
STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")


def tp_plan(model: nn.Module, *, owner: str) -> dict[str, str]:
    """The tensor-parallel plan of ``model`` (module path pattern → transformers style name):
    its own ``tp_plan``, else :data:`LLAMA_PLAN` for the Llama/Qwen2 family; refuses the rest
    and any style outside :data:`STYLES`, naming ``owner``."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not plan:
        if model_type not in LLAMA_FAMILY:
            raise ValueError(
                f"{owner}: {type(model).__name__} (model_type {model_type!r}) has no "
                "tensor-parallel plan (no tp_plan in transformers, not of the Llama/Qwen2 "
                f"family {sorted(LLAMA_FAMILY)}); train it with tp=1 (data parallel only)"
            )
        plan = dict(LLAMA_PLAN)
    unknown = {k: v for k, v in plan.items() if v not in STYLES}
    if unknown:
        raise ValueError(
            f"{owner}: {type(model).__name__}'s tensor-parallel plan uses styles rlblocks does "
            f"not translate: {unknown}; rlblocks takes {list(STYLES)}: train it with tp=1"
        )
    return plan


def check_layout(model: nn.Module, tp: int, *, owner: str) -> dict[str, str]:
    """``model``'s plan (:func:`tp_plan`), once its sizes are shown to split ``tp`` ways:
    attention heads, key-value heads, MLP features and vocabulary must each be divisible by
    ``tp`` (else ``ValueError`` naming the dimension and the sizes). Touches no process group.
    """
    plan = tp_plan(model, owner=owner)
    _check_matches(model, plan, owner=owner)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
    config = config or model.config
    sizes = {
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
        "vocab_size": _vocab_rows(model),
    }
    for name, size in sizes.items():
        if size is not None and size % tp:
            raise ValueError(
                f"{owner}: {name} = {size} is not divisible by the tensor-parallel size "
                f"tp = {tp}; pick a tp that divides {name} (and every size in {sizes})"
            )
    return plan


def _vocab_rows(model: nn.Module) -> int | None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
    return None if embeddings is None else int(embeddings.weight.shape[0])


def parallelize(model: nn.Module, mesh: Any, plan: dict[str, str]) -> None:
    """Split ``model`` over the 1-D device ``mesh`` by ``plan`` (:func:`check_layout`'s), in
    place, keeping tied input and output embeddings tied (one vocabulary-sharded parameter).

    Every rank of ``mesh`` must call it with the same model (the same initial weights: rank 0's
    are scattered). The output layer keeps the model's behaviour for direct calls (the
    logits gathered over the vocabulary), while the trainers' scoring reads its sharded
    weight and never gathers logits (``rlblocks.trainer.forward``).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tied = _tied(model)
    styles = {name: _style(style) for name, style in plan.items()}
    parallelize_module(model, mesh, styles)
    if tied:
        output = model.get_output_embeddings()  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
        # both vocabulary rows, Shard(0)
        output.weight = model.get_input_embeddings().weight  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module


def _tied(model: nn.Module) -> bool:
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None or get_out() is None:
        return False
    return get_in().weight is get_out().weight


def _style(name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    return RowwiseParallel(input_layouts=Replicate())  # embedding_rowwise: ids are whole


def _check_matches(model: nn.Module, plan: dict[str, str], *, owner: str) -> None:
    """Every pattern of the plan names at least one module (a plan of another model family
    would otherwise be applied to nothing and train the model whole, in silence)."""
    names = [n for n, _ in model.named_modules()]
    missing = [p for p in plan if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if missing:
        raise ValueError(
            f"{owner}: the tensor-parallel plan names modules {type(model).__name__} "
            f"does not have: {missing}; the plan does not fit this model: train it with tp=1"
        )


def check_groups(hosts: list[str], tp: int, *, owner: str) -> None:
    """Refuse a tensor-parallel group (``tp`` consecutive ranks) that spans machines:
    ``hosts[r]`` is rank r's host name. Its all-reduces run in every layer, forward and
    backward: across a network they would dominate the step. A Ray pool numbers its ranks node
    by node, so this holds when ``workers_per_node`` is a multiple of ``tp``."""
    for start in range(0, len(hosts), tp):
        group = hosts[start : start + tp]
        if len(set(group)) > 1:
            raise ValueError(
                f"{owner}: the tensor-parallel group of ranks {start}-{start + tp - 1} spans "
                f"the machines {sorted(set(group))}; give each node a multiple of tp = {tp} "
                "workers (Pool(workers_per_node=...)), so that each group stays on one node"
            )
