"""Sequence parallelism for packed forwards: Ulysses all-to-all over attention heads.

A packed micro-batch (:class:`~rlblocks.models.packing.Packed`: the rows' real tokens as one
``(1 n)`` sequence, position ids restarting at 0 per row) too long for one device is split
across the ``sp`` ranks of a process group (DeepSpeed-Ulysses, Jacobs et al. 2023, §3; verl's
``ulysses_sequence_parallel_size``). Every rank of the group holds the whole packed sequence's
ids (they are small); :func:`split` gives each rank a contiguous slice of ``l = ⌈n / sp⌉``
tokens, and the rank runs the model on its slice only: embeddings, norms, MLPs and the LM head
work token by token, and the rotary embeddings come from the slice's own position ids, which
are the whole sequence's positions of those tokens. Attention is the one place a token needs
the others. Inside every attention layer (:func:`sequence_parallel` installs the attention
function for the duration of the forward, as :func:`~rlblocks.models.packing.packed_attention`
does for one process):

1. an all-to-all turns q, k, v from ``(local sequence, all heads)`` into ``(whole sequence,
   heads / sp)``: ``(1 h l d)`` to ``(1 h/sp sp·l d)``;
2. the per-row causal attention of the packed path runs on the whole sequence, the rows found
   from the whole sequence's position ids;
3. a second all-to-all turns the output back to ``(1 l h d)`` for the layer's output projection.

Both all-to-alls are torch's differentiable functional collective: the backward of each is
the reverse all-to-all, so gradients reach the ranks whose tokens produced the keys and values.

**Padding**: ``n`` is padded up to ``sp·l`` with token id 0 at positions 0, 1, …: the padding
is a row of its own, last in the sequence. Causal attention within rows keeps the real rows from
attending to it (it comes after them, and is another row) and it from attending to them; its
outputs are dropped by :func:`gather` and by :meth:`Shard.local`.

**Grouped-query attention**: with ``h_kv`` key/value heads not divisible by ``sp``, each kv head
is repeated ``r = sp / gcd(h_kv, sp)`` times before the all-to-all (as verl repeats them
when ``h_kv < sp``), the fewest copies that split evenly; ``r`` always divides the group size
``h / h_kv`` when ``sp`` divides ``h``. ``h`` not divisible by ``sp`` is refused before any compute.

Typical use, every rank of ``group`` holding the same ``packed``::

    shard = split(packed.input_ids, packed.position_ids, group)
    with sequence_parallel(model, shard) as kwargs:
        logits = model(**kwargs).logits              # (1 l v): this rank's tokens only
    mine, local = shard.local(packed.keep)           # the kept positions this rank holds
    own = log_softmax(logits[0, local]).gather(-1, packed.targets[mine][:, None])[:, 0]
    logprobs = gather_at(own, packed.keep, shard)    # (m): every rank's, in keep's order
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from einops import rearrange, repeat
from torch import Tensor, nn

from rlblocks.models.packing import _attention_configs, attend_rows, attention_path

ULYSSES_ATTENTION = "rlblocks_ulysses"
"""The name under which the sequence-parallel attention is registered with transformers."""

_state = threading.local()  # the Shard of the sequence-parallel forward running in this thread


@dataclass(frozen=True)
class Shard:
    """One rank's slice of a packed sequence under sequence parallelism (:func:`split`).

    ``input_ids``, ``position_ids``: ``(1 l)`` int64, tokens ``[start, stop)`` of the whole
    sequence padded to ``size·l`` tokens (padding: id 0, positions 0, 1, …: a row of its own).
    ``bounds``: each row's ``[start, end)`` in the padded whole sequence, the padding last.
    ``length``: ``n``, the real tokens of the whole sequence. ``rank``, ``size``: this rank's
    place in ``group`` and the sequence-parallel degree ``sp``.
    """

    input_ids: Tensor
    position_ids: Tensor
    bounds: tuple[tuple[int, int], ...]
    length: int
    rank: int
    size: int
    group: dist.ProcessGroup

    @property
    def start(self) -> int:
        """The slice's first position in the whole sequence."""
        return self.rank * self.input_ids.shape[1]

    @property
    def stop(self) -> int:
        """One past the slice's last position in the (padded) whole sequence."""
        return self.start + self.input_ids.shape[1]

    def local(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """Which whole-sequence positions ``index`` ``(m)`` this slice holds, and where: a
        bool ``(m)`` mask and the ``(m')`` local positions of the held ones, in ``index``'s
        order (e.g. ``Packed.keep``: the outputs that score response tokens)."""
        mine = (index >= self.start) & (index < min(self.stop, self.length))
        return mine, index[mine] - self.start


def split(input_ids: Tensor, position_ids: Tensor, group: dist.ProcessGroup | None = None) -> Shard:
    """This rank's :class:`Shard` of the packed sequence ``input_ids``, ``position_ids``
    ``(1 n)`` (positions restart at 0 for each row, as ``Packed`` lays them out) over the
    ranks of ``group`` (default: every process). Every rank of the group passes the same
    sequence; nothing is communicated."""
    group = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    assert group is not None  # WORLD: get_rank has found the default group initialized
    if rank < 0:
        raise ValueError(
            f"ulysses.split: this process (global rank {dist.get_rank()}) is not in the "
            "sequence-parallel group it was given; call split on that group's ranks only"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"ulysses.split: input_ids {tuple(input_ids.shape)} and position_ids "
            f"{tuple(position_ids.shape)} are not one packed (1 n) sequence of the same shape; "
            "pass Packed.input_ids and Packed.position_ids"
        )
    n = input_ids.shape[1]
    if n == 0 or int(position_ids[0, 0]) != 0:
        first = None if n == 0 else int(position_ids[0, 0])
        raise ValueError(
            f"ulysses.split: the packed sequence has {n} tokens, the first at position {first}; "
            "a packed sequence starts a row at position 0 (pack it with rlblocks.trainer.packing.pack)"
        )
    l = -(-n // size)  # ⌈n / sp⌉
    pad = size * l - n
    ids = torch.cat([input_ids, input_ids.new_zeros(1, pad)], dim=1)
    positions = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)[None]], 1)
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    bounds = tuple(zip(starts, [*starts[1:], size * l], strict=True))
    window = slice(rank * l, (rank + 1) * l)
    return Shard(ids[:, window], positions[:, window], bounds, n, rank, size, group)


def gather(local: Tensor, shard: Shard) -> Tensor:
    """The whole sequence's per-token values from every rank's slice: ``local`` ``(1 l …)``
    gives ``(1 n …)`` (padding dropped), on every rank of the group.

    Differentiable through this rank's own slice only: the backward hands this rank the
    gradient of its own positions. That is right when every rank of the group computes the
    same loss from the gathered values: each rank then backpropagates its own tokens'
    share, and the gradient of a parameter summed over the group's ranks is the gradient of
    that loss (the other ranks' values are constants here; their own ranks carry them)."""
    parts = [torch.empty_like(local) for _ in range(shard.size)]
    dist.all_gather(parts, local.detach().contiguous(), group=shard.group)
    parts[shard.rank] = local
    return torch.cat(parts, dim=1)[:, : shard.length]


def gather_at(values: Tensor, index: Tensor, shard: Shard) -> Tensor:
    """Values at whole-sequence positions ``index`` ``(m)`` from the ranks that hold them:
    ``values`` ``(m' …)`` are this rank's, at the positions :meth:`Shard.local` gives it (in
    that order); returns ``(m …)`` on every rank of the group, differentiable as
    :func:`gather` (through this rank's own values). E.g. log-probs of ``Packed.targets``
    scored at this rank's share of ``Packed.keep``, back in ``keep``'s order."""
    _, local = shard.local(index)
    grid = values.new_zeros(shard.input_ids.shape[1], *values.shape[1:])  # (l …)
    whole = gather(grid.index_put((local,), values)[None], shard)[0]
    return whole[index]


@contextlib.contextmanager
def sequence_parallel(model: nn.Module, shard: Shard, *, tp: int = 1) -> Iterator[dict[str, Any]]:
    """The keyword arguments of ``model``'s forward over this rank's slice of the packed
    sequence, with the sequence-parallel attention in effect while the block runs: every
    attention layer then attends over the whole sequence through two all-to-alls per layer
    (module docstring). Every rank of ``shard.group`` must run the same forward. ``tp``: the
    tensor-parallel size the model's attention heads are already split by (each rank then
    holds ``heads / tp`` of them, which the sequence-parallel size must divide).

    Refused (``ValueError``/``RuntimeError``) before any compute: attention heads not
    divisible by ``tp · shard.size``, a model whose attention the packed row path does not serve
    (``rlblocks.models.packing.attention_path``), a gradient-checkpointed model in grad mode
    (its backward would recompute the layers after the block restored their attention).
    Restores the model's own attention implementation at the end."""
    _check_model(model, shard.size, tp)
    from transformers import AttentionInterface

    # No mask function registered: transformers builds none (module docstring of packing).
    AttentionInterface.register(ULYSSES_ATTENTION, _ulysses_attention)
    configs = _attention_configs(model)
    saved = [config._attn_implementation for config in configs]
    previous = getattr(_state, "shard", None)
    for config in configs:
        config._attn_implementation = ULYSSES_ATTENTION
    _state.shard = shard
    try:
        yield {"input_ids": shard.input_ids, "position_ids": shard.position_ids, "use_cache": False}
    finally:
        for config, implementation in zip(configs, saved, strict=True):
            config._attn_implementation = implementation
        _state.shard = previous


def _check_model(model: nn.Module, sp: int, tp: int) -> None:
    """Refuse what the sequence-parallel attention cannot run, naming the sizes."""
    name = type(model).__name__
    path = attention_path(model)
    if path != "rows":
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise ValueError(
            f"ulysses.sequence_parallel: {name} (implementation {implementation!r}) takes the "
            f"{path!r} packed-attention path: its attention is more than causal (a sliding "
            "window, soft-capped scores, sinks) or not sdpa/eager, and sequence parallelism runs "
            "plain causal attention per row; train it with sp=1, or load a full-attention model "
            "with attn_implementation='sdpa'"
        )
    if torch.is_grad_enabled() and getattr(model, "is_gradient_checkpointing", False):
        raise RuntimeError(
            f"ulysses.sequence_parallel: {name} recomputes its layers in the backward pass "
            "(gradient checkpointing), after this block has restored their attention; call "
            "model.gradient_checkpointing_disable() under sequence parallelism"
        )
    for config in _attention_configs(model):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", None)
        if heads is not None and heads % (tp * sp) != 0:
            sizes = (
                f"the sequence-parallel size sp = {sp}"
                if tp == 1
                else f"tp·sp = {tp}·{sp} = {tp * sp}"
            )
            share = "heads / sp" if tp == 1 else "heads / (tp·sp)"
            choices = [k for k in range(1, heads + 1) if heads % (tp * k) == 0]
            raise ValueError(
                f"ulysses.sequence_parallel: num_attention_heads = {heads} of {name} is not "
                f"divisible by {sizes} (each rank attends over {share} of them); choose sp "
                f"among {choices}"
            )


def _ulysses_attention(
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
    """Transformers' attention function signature: ``query`` ``(1 h l d)``, ``key``/``value``
    ``(1 h_kv l d)`` of this rank's ``l`` tokens; returns ``(1 l h d)`` and no weights."""
    shard: Shard | None = getattr(_state, "shard", None)
    if shard is None or query.shape[2] != shard.input_ids.shape[1] or attention_mask is not None:
        raise RuntimeError(
            f"ulysses.sequence_parallel: the sequence-parallel attention was called outside "
            f"its forward (queries {tuple(query.shape)}, mask {attention_mask is not None}); run "
            "the model on the kwargs that sequence_parallel(model, shard) yields, inside its block"
        )
    group, sp = shard.group, shard.size
    key, value = _repeat_kv(key, sp), _repeat_kv(value, sp)
    q, k, v = (_heads_to_sequence(x, group, sp) for x in (query, key, value))
    p = dropout if module.training else 0.0
    out = attend_rows(q, k, v, shard.bounds, scale=scaling, dropout_p=p)  # (1 h/sp n d)
    return _sequence_to_heads(out, group, sp), None


def _repeat_kv(x: Tensor, sp: int) -> Tensor:
    """``(1 h_kv l d)`` with each kv head repeated ``r = sp / gcd(h_kv, sp)`` times in place
    (grouped-query order: query head j reads kv head j // (h / h_kv) before and after)."""
    r = sp // math.gcd(x.shape[1], sp)
    return x if r == 1 else repeat(x, "b h l d -> b (h r) l d", r=r)


def _heads_to_sequence(x: Tensor, group: dist.ProcessGroup, sp: int) -> Tensor:
    """``(1 h l d)`` (this rank's tokens, all heads) to ``(1 h/sp sp·l d)`` (every token, this
    rank's heads): head block s goes to rank s, and rank s' tokens arrive as block s."""
    send = rearrange(x, "b (s h) l d -> s b h l d", s=sp).contiguous()
    received = funcol.all_to_all_single(send, None, None, group)
    return rearrange(received, "s b h l d -> b h (s l) d")


def _sequence_to_heads(x: Tensor, group: dist.ProcessGroup, sp: int) -> Tensor:
    """The reverse of :func:`_heads_to_sequence`, laid out as transformers' attention output:
    ``(1 h/sp sp·l d)`` to ``(1 l h d)``."""
    send = rearrange(x, "b h (s l) d -> s b h l d", s=sp).contiguous()
    received = funcol.all_to_all_single(send, None, None, group)
    return rearrange(received, "s b h l d -> b l (s h) d").contiguous()
