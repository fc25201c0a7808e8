"""Padding-free forwards: rows as one sequence, attention kept per row.

``Packed`` is the layout (``rlblocks.trainer.packing.pack`` builds it from ``Rollouts``, a
reward model from its token-id rows); this module runs a model over it. A right-padded ``(b s)``
batch of responses of very different lengths computes every padding
column in every layer. Packed, the real tokens of all rows are concatenated into one ``(1 n)``
sequence, ``n = Σ_i len_i``, with position ids restarting at 0 for each row (so each row gets
the rotary positions it gets alone), and attention kept within each row.

How attention is kept within each row (:func:`packed_attention`):

- **sdpa and eager models** run, for the duration of the forward, an attention function
  registered with transformers' ``AttentionInterface`` under :data:`ROW_ATTENTION`: one
  ``scaled_dot_product_attention(..., is_causal=True)`` per row over that row's slice of the
  packed queries, keys and values (on a GPU: the rows right-padded into one batch inside the
  attention, one call per layer; :func:`attend_rows`). It costs Σ_i len_i² per layer, what
  the rows cost alone;
  transformers' own packed path for these implementations builds a dense ``(n n)``
  block-causal mask and computes n² (on SmolLM2-135M, 16 rows of 48-104 tokens, one CPU
  thread: forward + backward 21.5 s dense, 16.0 s per row, 20.0 s right-padded).
- **flash-attention models** (``flash_attention_2/3``, on a GPU) are given the packed
  position ids with no attention mask: transformers derives the varlen ``cu_seqlens`` from
  them, which is the kernel's own packed mode.
- Models whose attention takes more than a causal mask (a sliding window, soft-capped
  scores, attention sinks) or another implementation go through transformers' own packed
  masks (position ids, no attention mask, no cache), which apply the model's own rules.

Whatever the path, :func:`check_isolation` runs once per model and path before its first
packed forward: it packs two rows twice, the second row the same and the first row's tokens
changed, and requires the second row's outputs to be equal. With attention kept within rows
they are exactly equal (the same shapes run the same kernels; the first row's keys get
probability exactly 0); with attention mixed across rows, they differ. A model that fails is
refused with the fix (``packing=False``), never trained on mixed rows. (Transformers' own
path mixes rows silently when a cache is passed: its packed-sequence detection is skipped
whenever ``past_key_values`` is set, and a forward with ``use_cache`` on creates one.)
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlblocks.models import varlen as _varlen

ROW_ATTENTION = "rlblocks_rows"
"""The name under which :func:`_row_attention` is registered with transformers."""

_FLASH = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
_ROWWISE = ("sdpa", "eager")
_state = threading.local()  # the models inside kept_apart in this thread; a padded-index cache
_BOUNDS: dict[int, tuple[tuple[int, int], ...]] = {}
"""The row bounds of each model's latest packed forward, keyed by ``id`` of each of its
attention configs (the attention function finds them from its module's ``config``). Not
thread-local: on a GPU, autograd runs the backward pass, and with it the layers a
gradient-checkpointed model recomputes, in a thread of its own."""

VARLEN: bool | None = None
"""Whether the row attention uses torch's variable-length flash kernel
(``rlblocks.models.varlen``): None, where it serves (CUDA, fp16/bf16, a torch that has it);
False to pad the rows inside the attention instead (:data:`BATCHED`)."""

BATCHED: bool | None = None
"""How the row attention computes (:func:`attend_rows`): None, in one call on a GPU and one
call per row elsewhere; True or False for every device."""


@dataclass(frozen=True)
class Packed:
    """The real tokens of a ``Rollouts`` batch as one sequence, and where its scores go.

    ``input_ids``, ``position_ids``: ``(1 n)`` int64, the rows' real tokens (prompt, then
    response) one row after another, positions restarting at 0 per row. ``bounds``: each
    row's ``[start, end)`` in the sequence. ``keep``: ``(m)`` int64, the positions whose
    outputs score the ``m`` real response tokens (the position before each), in row-major
    order; ``targets``: ``(m)`` those tokens; ``rows``, ``cols``: ``(m)`` where each score goes
    in the batch's ``(b t)`` response grid.
    """

    input_ids: Tensor
    position_ids: Tensor
    bounds: tuple[tuple[int, int], ...]
    keep: Tensor
    targets: Tensor
    rows: Tensor
    cols: Tensor
    shape: tuple[int, int]

    @property
    def length(self) -> int:
        """n, the tokens computed."""
        return self.input_ids.shape[1]

    def scatter(self, values: Tensor) -> Tensor:
        """``(m)`` scores (one per real response token, ``keep``'s order) as the batch's
        ``(b t)`` grid, 0 at response padding; differentiable through ``values``."""
        grid = values.new_zeros(self.shape)
        return grid.index_put((self.rows, self.cols), values)


def attention_path(model: nn.Module) -> str:
    """How :func:`packed_attention` keeps ``model``'s rows apart: ``"rows"`` (one sdpa call
    per row), ``"flash"`` (the varlen kernel, from the position ids) or ``"transformers"``
    (transformers' packed masks)."""
    configs = _attention_configs(model)
    if not configs:
        return "transformers"
    implementation = configs[0]._attn_implementation
    if implementation in _FLASH:
        return "flash"
    if implementation in (*_ROWWISE, ROW_ATTENTION) and not _needs_model_rules(configs[0]):
        return "rows"
    return "transformers"


def _needs_model_rules(config: Any) -> bool:
    """True when the model's attention is more than causal: sliding windows in use, soft-capped
    scores, attention sinks. Those go through transformers' own packed masks."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        return True
    window = getattr(text, "sliding_window", None)
    if window is not None and getattr(text, "use_sliding_window", True) and layer_types is None:
        return True
    return any(
        getattr(text, name, None) is not None for name in ("attn_logit_softcapping", "sinks")
    )


@contextlib.contextmanager
def packed_attention(model: nn.Module, packed: Packed) -> Iterator[dict[str, Any]]:
    """The keyword arguments of a packed forward of ``model`` over ``packed``, with the row
    attention in effect while the block runs (``"rows"`` path). Inside :func:`kept_apart` of
    the same model the row attention and these bounds stay in effect after the block, until
    the next packed forward or the end of :func:`kept_apart`: the backward pass of a
    gradient-checkpointed model recomputes its layers then, and must get the same attention."""
    kwargs: dict[str, Any] = {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "use_cache": False,  # a cache turns transformers' packed-sequence masks off
    }
    if attention_path(model) != "rows":
        yield kwargs
        return
    if _in_span(model):
        _set_bounds(model, packed.bounds)
        yield kwargs
        return
    if torch.is_grad_enabled() and getattr(model, "is_gradient_checkpointing", False):
        raise RuntimeError(
            f"packed_attention: {type(model).__name__} recomputes its layers in the backward "
            "pass (gradient checkpointing), after this forward's row attention has ended; "
            "run the forward and its backward inside rlblocks.trainer.packing.kept_apart(model)"
        )
    with kept_apart(model):
        _set_bounds(model, packed.bounds)
        yield kwargs


@contextlib.contextmanager
def kept_apart(model: nn.Module) -> Iterator[None]:
    """Row attention in effect for ``model`` (``"rows"`` path; nothing otherwise) for the whole
    block: packed forwards inside it and their backward passes, recomputed layers included.
    Restores the model's own attention implementation at the end."""
    if attention_path(model) != "rows" or _in_span(model):
        yield
        return
    _register()
    keys = [id(config) for config in _attention_configs(model)]
    previous = {key: _BOUNDS[key] for key in keys if key in _BOUNDS}
    spans = _spans()
    spans.add(id(model))
    try:
        with attention_implementation(model, ROW_ATTENTION):
            yield
    finally:
        spans.discard(id(model))
        for key in keys:
            _BOUNDS.pop(key, None)
        _BOUNDS.update(previous)


def _set_bounds(model: nn.Module, bounds: tuple[tuple[int, int], ...]) -> None:
    for config in _attention_configs(model):
        _BOUNDS[id(config)] = bounds


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """Every attention layer of ``model`` runs the implementation registered as ``name``
    (transformers' ``AttentionInterface``) while the block runs; each config's own is restored
    after."""
    configs = _attention_configs(model)
    saved = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = name
    try:
        yield
    finally:
        for config, implementation in zip(configs, saved, strict=True):
            config._attn_implementation = implementation


def _spans() -> set[int]:
    if not hasattr(_state, "spans"):
        _state.spans = set()
    return _state.spans


def _in_span(model: nn.Module) -> bool:
    return id(model) in _spans()


def _attention_configs(model: nn.Module) -> list[Any]:
    """Every distinct config object of ``model``'s modules (a model and its sub-models may
    hold their own), each of which the attention layers read their implementation from."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def _register() -> None:
    from transformers import AttentionInterface

    # No mask function is registered: transformers then builds no mask for this attention
    # (each row's causal mask is sdpa's is_causal) and skips its packed-sequence detection,
    # which reads a value back from the device on every forward.
    AttentionInterface.register(ROW_ATTENTION, _row_attention)


def _row_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention within each row of a packed sequence (transformers' attention function
    signature: ``query`` ``(1 h n d)``, ``key``/``value`` ``(1 h_kv n d)``; returns ``(1 n h
    d)`` and no weights)."""
    # In a compiled block the bounds are read by the operator at run time, not here: reading
    # them while tracing would make them constants of the graph.
    compiling = torch.compiler.is_compiling()
    bounds = None if compiling else _BOUNDS.get(id(getattr(module, "config", None)))
    if (bounds is None and not compiling) or query.shape[0] != 1 or attention_mask is not None:
        raise RuntimeError(
            f"packed_attention: the row attention was called outside a packed forward (batch {query.shape[0]}, mask "
            f"{attention_mask is not None}); this attention only serves packed_attention"
        )
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise RuntimeError(
                f"packed_attention: the model passes {name}={kwargs[name]!r}, which row "
                "attention does not apply; train this model with packing=False"
            )
    p = dropout if module.training else 0.0
    if compiling:  # a compiled decoder block (rlblocks.models.regional)
        if p:
            raise RuntimeError(
                f"packed_attention: attention dropout {p} in a compiled block is not built; "
                "train with TrainConfig(compile=False), or a model without attention dropout"
            )
        out = torch.ops.rlblocks.row_attention(query, key, value, _bounds_key(module), scaling)
    else:
        assert bounds is not None  # checked above
        out = attend_rows(query, key, value, bounds, scale=scaling, dropout_p=p, batched=BATCHED)
    return out.transpose(1, 2).contiguous(), None


def _bounds_key(module: nn.Module) -> int:
    """The key of ``module``'s row bounds in ``_BOUNDS`` (the id of its config)."""
    return id(module.config)


# A compiled decoder block cannot trace the row attention: its bounds are Python ints that
# change with every micro-batch (a recompile each time). The block calls this operator
# instead, opaque to the compiler, which reads the bounds at run time from the packed
# forward in effect (the key is the attention config's id, a constant of the graph). Its
# backward recomputes the attention of each row under autograd: one more attention forward
# per layer, a small share of a layer's work at the rows' lengths (the projections and MLP
# cost ~12 d² per token, attention ~2 n d).
def _compiled_bounds(key: int) -> tuple[tuple[int, int], ...]:
    bounds = _BOUNDS.get(key)
    if bounds is None:
        raise RuntimeError(
            "packed_attention: a compiled block's row attention ran with no packed forward in "
            "effect (its backward after packed_attention ended?); run the forward and its "
            "backward inside rlblocks.trainer.packing.kept_apart(model)"
        )
    return bounds


@torch.library.custom_op("rlblocks::row_attention", mutates_args=())
def _row_attention_op(
    query: Tensor, key: Tensor, value: Tensor, bounds_key: int, scale: float | None
) -> Tensor:
    bounds = _compiled_bounds(bounds_key)
    return attend_rows(query, key, value, bounds, scale=scale, batched=BATCHED).contiguous()


@_row_attention_op.register_fake
def _row_attention_fake(
    query: Tensor, key: Tensor, value: Tensor, bounds_key: int, scale: float | None
) -> Tensor:
    return query.new_empty(query.shape)


@torch.library.custom_op("rlblocks::row_attention_backward", mutates_args=())
def _row_attention_backward_op(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, bounds_key: int, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    bounds = _compiled_bounds(bounds_key)

    def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # sdpa, whose torch.func support is certain; the same function as the forward's kernel
        return attend_rows(q, k, v, bounds, scale=scale, batched=BATCHED, varlen=False)

    # torch.func, not torch.autograd: an operator's kernel runs below the autograd dispatch.
    vjp: Any = torch.func.vjp(attention, query, key, value)[1]
    dq, dk, dv = vjp(grad)  # one gradient per input of attention
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_row_attention_backward_op.register_fake
def _row_attention_backward_fake(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, bounds_key: int, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _row_attention_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    query, key, value, bounds_key, scale = inputs
    ctx.save_for_backward(query, key, value)
    ctx.bounds_key, ctx.scale = bounds_key, scale


def _row_attention_grad(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
    query, key, value = ctx.saved_tensors
    dq, dk, dv = torch.ops.rlblocks.row_attention_backward(
        grad, query, key, value, ctx.bounds_key, ctx.scale
    )
    return dq, dk, dv, None, None


_row_attention_op.register_autograd(_row_attention_grad, setup_context=_row_attention_setup)


def attend_rows(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bounds: tuple[tuple[int, int], ...],
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    batched: bool | None = None,
    varlen: bool | None = None,
) -> Tensor:
    """Causal attention within each row ``[start, end)`` of ``bounds``. ``query`` ``(1 h n
    d)``, ``key``/``value`` ``(1 h_kv n d)`` (grouped-query when ``h_kv < h``); returns ``(1 h
    n d)``. The bounds must cover ``[0, n)`` in order.

    Two ways, the same numbers up to kernel rounding: one
    ``scaled_dot_product_attention(..., is_causal=True)`` per row (``batched=False``, the CPU
    default: it computes Σ len_i² and each call is large enough there), or the rows gathered
    right-padded into one ``(r h L d)`` batch and one causal call over it (``batched=True``,
    the default on a GPU, where each call is a kernel launch of a few microseconds of work: on
    an H100, a 32-row micro-batch of Qwen2.5-0.5B's shape in bf16, forward and backward, took
    0.279 s one call per row, 0.131 s batched, 0.169 s padded; docs/gpu.md). Right padding
    needs no mask under a causal mask: a real query only sees earlier positions of its own
    row; the padded queries' outputs are dropped, so they send no gradient back. On a GPU
    in fp16/bf16 a third way comes first where torch has it (``varlen``, :data:`VARLEN`): the
    variable-length flash kernel over the packed rows, no padding at all
    (``rlblocks.models.varlen``)."""
    if varlen is None:
        varlen = VARLEN
    if varlen is not False and not dropout_p and len(bounds) > 1 and _varlen.serves(query):
        return _varlen.attend(query, key, value, bounds, scale=scale)
    if batched is None:
        batched = query.is_cuda
    gqa = query.shape[1] != key.shape[1]
    if batched and len(bounds) > 1:
        gather, real = _padded_index(bounds, query.device)
        rows, width = gather.shape

        def padded(x: Tensor) -> Tensor:  # (1 h n d) -> (r h L d)
            h, d = x.shape[1], x.shape[3]
            return x[0].index_select(1, gather.flatten()).view(h, rows, width, d).transpose(0, 1)

        out = F.scaled_dot_product_attention(
            padded(query),
            padded(key),
            padded(value),
            dropout_p=dropout_p,
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )  # (r h L d)
        h, d = out.shape[1], out.shape[3]
        return out.transpose(0, 1).reshape(h, rows * width, d).index_select(1, real)[None]
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout_p,
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )
        for start, end in bounds
    ]
    return torch.cat(outputs, dim=2)


def _padded_index(
    bounds: tuple[tuple[int, int], ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    """``gather`` ``(r L)``: the packed position of each row's j-th token, right-padded with
    the row's last position (seen only by padded queries); ``real`` ``(n)``: where each packed
    token sits in the flattened ``(r L)`` grid. Kept per thread for the last bounds seen: every
    layer of one forward asks for the same."""
    cached = getattr(_state, "padded", None)
    if cached is not None and cached[0] == bounds and cached[1] == device:
        return cached[2], cached[3]
    starts = torch.tensor([s for s, _ in bounds])
    lengths = torch.tensor([e - s for s, e in bounds])
    width = int(lengths.max())
    j = torch.arange(width)
    gather = starts[:, None] + torch.minimum(j[None], lengths[:, None] - 1)
    real = (torch.arange(len(bounds))[:, None] * width + j[None])[j[None] < lengths[:, None]]
    gather, real = gather.to(device), real.to(device)
    _state.padded = (bounds, device, gather, real)
    return gather, real


# ---------------------------------------------------------------------- isolation check
_checked: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def check_isolation(model: nn.Module, *, owner: str) -> None:
    """Refuse ``model`` for packed forwards when its attention reaches across rows (module
    docstring); checked once per model and attention path, in no-grad mode, on 2 rows of 3
    and 2 tokens."""
    path = attention_path(model)
    done = _checked.setdefault(model, set())
    if path in done:
        return
    device = next(model.parameters()).device
    # Token ids below 9: inside any vocabulary.
    first = torch.tensor([[1, 2, 3, 7, 8]], device=device)
    changed = torch.tensor([[4, 5, 6, 7, 8]], device=device)
    outputs = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for ids in (first, changed):
                probe = Packed(
                    input_ids=ids,
                    position_ids=torch.tensor([[0, 1, 2, 0, 1]], device=device),
                    bounds=((0, 3), (3, 5)),
                    keep=torch.arange(5, device=device),
                    targets=ids[0],
                    rows=torch.zeros(5, dtype=torch.long, device=device),
                    cols=torch.arange(5, device=device),
                    shape=(1, 5),
                )
                with packed_attention(model, probe) as kwargs:
                    out = model(**kwargs)
                    out = out.logits if hasattr(out, "logits") else out[0]
                    outputs.append(out[0, 3:].float())
    finally:
        model.train(was_training)
    if not torch.equal(outputs[0], outputs[1]):
        gap = float((outputs[0] - outputs[1]).abs().max())
        name = type(model).__name__
        raise ValueError(
            f"{owner}: packed rows of {name} attend to each other (attention path {path!r}, "
            f"implementation {getattr(getattr(model, 'config', None), '_attn_implementation', None)!r}: "
            f"a row's logits moved by {gap:.3g} when the row before it changed); train it with "
            "packing=False, or load it with attn_implementation='sdpa'"
        )
    done.add(path)
