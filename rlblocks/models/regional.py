"""Regional compilation: each decoder block of a Hugging Face causal LM compiled on its own.

``torch.compile`` of a whole model recompiles whenever anything outside the blocks changes and
takes minutes on a large one; compiling the repeated block is what torchtitan and Hugging Face
call regional compilation: one graph, traced once, serves every layer of the model (the
layers share their class's code, and their parameters are inputs of the graph, not constants),
forward and backward. The rest of the model (embedding, rotary tables, the final norm, the
chunked scoring head of ``rlblocks.trainer.forward``) stays eager around it.

Decisions worth knowing:

- **Shapes.** Each block is compiled with ``dynamic=True``: the token count of a packed
  micro-batch (or the rows and columns of a padded one) is a symbol of the graph, so a run of
  mixed lengths compiles each block once and never again, with no padding computed. (Bucketing
  the token counts would waste the padding's compute for the same effect.)
- **Packed rows.** The row attention of ``rlblocks.models.packing`` is, inside a compiled
  block, the operator ``rlblocks::row_attention``: opaque to the compiler, it reads the rows'
  bounds at run time, so the bounds are no constant of the graph.
- **What wraps a block stays eager**: gradient checkpointing (Hugging Face's layer ``__call__``)
  and FSDP2's gather hooks run around the compiled ``forward``, as torchtitan orders them.
- **LoRA** compiles too: peft's adapter layers sit inside the blocks and trace with them.
- **Refused by name**: tensor and sequence parallelism (their attention and DTensor layers
  are not traced here), attention implementations other than sdpa / eager / the row
  attention, and a module without Hugging Face decoder blocks.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_COMPILED: dict[type, Callable[..., Any]] = {}
"""One compiled ``forward`` per decoder-block class, shared by every block of that class."""

_SERVED = ("sdpa", "eager", "rlblocks_rows")
"""Attention implementations a compiled block traces."""


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of ``model`` (a peft wrapper's base model too): its Hugging Face
    ``GradientCheckpointingLayer`` modules, in order; empty when it has none."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_blocks(model: nn.Module, *, owner: str) -> int:
    """Compile the ``forward`` of every decoder block of ``model`` in place
    (``torch.compile(fullgraph=True, dynamic=True)``, one graph per block class); returns how
    many. Idempotent. ``owner`` names the block that asked, in the errors: a model with no
    decoder blocks, or an attention implementation a compiled block does not trace."""
    blocks = decoder_blocks(model)
    if not blocks:
        raise ValueError(
            f"{owner}: compile=True needs a Hugging Face causal LM with decoder blocks "
            f"(GradientCheckpointingLayer modules); {type(model).__name__} has none; pass "
            "compile=False"
        )
    config: Any = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", "sdpa")
    if implementation not in _SERVED:
        raise ValueError(
            f"{owner}: compile=True traces the attention implementations {list(_SERVED[:2])}, "
            f"the model runs {implementation!r}; load it with attn_implementation='sdpa', or "
            "pass compile=False"
        )
    for block in blocks:
        if is_compiled(block):
            continue
        cls = type(block)
        if cls not in _COMPILED:
            _COMPILED[cls] = torch.compile(cls.forward, fullgraph=True, dynamic=True)
        # A method of this block (deepcopy rebinds it to the copy), not a closure over it.
        block.forward = types.MethodType(_COMPILED[cls], block)
    return len(blocks)


def is_compiled(block: nn.Module) -> bool:
    """True when ``block``'s ``forward`` is the compiled one of :func:`compile_blocks`."""
    forward = block.__dict__.get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _COMPILED.get(type(block))
