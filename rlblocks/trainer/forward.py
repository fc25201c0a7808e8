"""Scoring the response tokens of a ``Rollouts`` batch with a causal LM.

A row is ``[pad … pad, prompt, response, pad … pad]`` (prompt left-padded, response
right-padded). For a causal LM the logits at position j predict token j + 1, so the ``t``
response tokens at columns tp … tp+t−1 are scored by the hidden states at columns
tp−1 … tp+t−2: the last t + 1 columns, minus the very last one.

Only those columns go through the LM head. We pass ``logits_to_keep`` to the model's own
``forward`` (the argument of every generated Hugging Face causal LM since transformers 4.50;
peft wrappers forward it to the base model) as the 1-D tensor of those t column indices, which
the models use to index the hidden states: the logits come out ``(b t v)`` and contiguous. (TRL
passes the int t + 1 and drops the last column; the sliced view then costs a ``(b t v)`` copy
when the log-probs flatten it, and one more column through the head.) A model that takes only
an int (its output has another width) gets its last t + 1 columns sliced as TRL does. Calling
``model.model`` and ``model.lm_head`` ourselves would be as cheap but would skip what some
models do after the head (Gemma-2's logit soft-capping, Cohere's logit scale); a model whose
``forward`` has no ``logits_to_keep`` gets full logits, sliced afterwards: correct, just more
memory.

**Packed** (``packing=True``, :mod:`rlblocks.trainer.packing`): the rows' real tokens run as
one sequence with attention kept per row, and ``logits_to_keep`` lists the packed positions
that score response tokens; the scores go back to the ``(b t)`` grid. Nothing is computed for
padding.

**No (b t v) logits**: where the model's output layer is a plain ``nn.Linear`` and nothing
follows it in ``forward`` (no logit soft-capping or scaling), it is swapped, for the duration of
the forward, for a module that takes the kept hidden states straight to log-probs (and
entropies) chunk by chunk (``rlblocks.losses.entropy.linear_token_scores``): only
``chunk_size × v`` logits exist at a time, forward and backward. The swap happens inside the
model's own ``forward``, so FSDP's gathering of the head's weight and peft's wrappers work as
for the real head; the model's returned ``logits`` must be the swapped module's output, or
this falls back to full logits. Other models get the logits and score them in chunks.

**Sampling replay** (``replay=True`` and a batch whose engine recorded ``Rollouts.sampler``):
each response token is scored under the distribution its row was sampled from, the tempered one
renormalized over what top-k then top-p kept (:mod:`rlblocks.losses.truncation`), the kept set
rebuilt chunk by chunk from the trainer's own logits. A row sampled at another temperature than
the one scored at is refused, and so is a vocabulary-sharded head (tensor parallelism). A
batch without ``sampler`` runs exactly the code it ran before.

Position ids follow the attention mask, ``position_ids = clamp(cumsum(mask) − 1, min=0)`` (as
verl's ``compute_position_id_with_mask``), so a left-padded prompt gets the same rotary
positions as the unpadded one. Padding columns get position 0 (left) or repeat the last position
(right); they are never attended to, and their scores are set to 0.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from rlblocks.losses.entropy import (
    entropy_from_logits,
    linear_token_scores,
    token_logprobs,
    vocab_parallel_token_scores,
)
from rlblocks.losses.truncation import Truncation
from rlblocks.models.context import check_rows
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.packing import check_isolation, pack, packed_attention


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions of real tokens counted from each row's first real token.

    position_ids = max(cumsum(mask) − 1, 0). Shapes: ``attention_mask`` ``(b s)`` bool or
    int; returns ``(b s)`` int64. Nothing to detach (integer output).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def check_scorable(model: nn.Module, rollouts: Rollouts, *, owner: str) -> None:
    """Refuse rollouts a forward over prompt + response cannot score, naming ``owner``: rows
    without a prompt column (``tp = 0``: the first response token is predicted from the last
    prompt token), or rows longer than ``model``'s context (:func:`check_rows`)."""
    if rollouts.prompt_ids.shape[1] == 0:
        raise ValueError(
            f"{owner}: rollouts have no prompt column (tp = 0); give every row at least one "
            "prompt token"
        )
    check_rows(model, rollouts.attention_mask, owner=owner)


def response_logits(
    model: nn.Module, rollouts: Rollouts, *, temperature: float = 1.0, bf16: bool = False
) -> Tensor:
    """Logits that score each response token, divided by the sampling temperature.

    z_{i,k} = f_θ(x_{i, <tp+k})[tp+k−1] / T for response token k of row i (T = ``temperature``).

    Shapes: returns ``(b t v)`` in the model's dtype (bf16 under ``bf16`` autocast), with the
    gradient of the model's parameters when grad mode is on. Rows need at least one prompt
    column (``tp >= 1``): the first response token is predicted from the last prompt token.
    """
    check_scorable(model, rollouts, owner="response_logits")
    t, mask = rollouts.response_ids.shape[1], rollouts.attention_mask
    kwargs = {
        "input_ids": rollouts.input_ids,
        "attention_mask": mask.long(),
        "position_ids": position_ids(mask),
        "use_cache": False,  # never needed here; and required with gradient checkpointing
    }
    s = mask.shape[1]
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = torch.arange(s - t - 1, s - 1, device=mask.device)
    device_type = mask.device.type
    autocast = (
        torch.autocast(device_type=device_type, dtype=torch.bfloat16)
        if bf16
        else contextlib.nullcontext()
    )
    with autocast:
        logits = model(**kwargs).logits
    if logits.shape[1] != t:  # full logits, or the last t + 1 (an int-only logits_to_keep)
        logits = logits[:, logits.shape[1] - (t + 1) : logits.shape[1] - 1]
    return logits if temperature == 1.0 else logits / temperature


def score_responses(
    model: nn.Module,
    rollouts: Rollouts,
    *,
    temperature: float = 1.0,
    bf16: bool = False,
    chunk_size: int,
    entropy: bool = False,
    packing: bool = False,
    sequence: Any = None,
    replay: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the response tokens under ``model``, chunked over tokens.

    logprobs_{i,k} = log softmax(z_{i,k})[y_{i,k}],  entropy_{i,k} = H(softmax(z_{i,k})), with z
    the logits of :func:`response_logits` (temperature applied), computed at most
    ``chunk_size`` tokens at a time in float32, without the ``(b t v)`` logits where the
    model's head allows (module docstring). Both are 0 at response padding. ``packing``: run
    the rows padding-free (module docstring); the model must keep packed rows apart
    (``rlblocks.trainer.packing.check_isolation``, else ``ValueError``). ``sequence``: a
    sequence-parallel process group (``packing`` only): every rank of it passes the same rows,
    runs the model on its slice of the packed tokens (``rlblocks.models.ulysses``) and gets
    every rank's scores; each rank's gradient then covers its own tokens. ``replay``: score the
    truncated distribution each row's ``rollouts.sampler`` records (module docstring; the
    policy's log-probs use it, a reference or teacher model's do not); a row recorded at a
    temperature other than ``temperature`` raises ``ValueError``.

    Shapes: returns ``(b t)`` ``logprobs`` and ``(b t)`` ``entropy`` (``None`` unless
    ``entropy``), float32 (float64 for a float64 model). Both carry the gradient of the model's
    parameters when grad mode is on; nothing is detached here.
    """
    check_scorable(model, rollouts, owner="score_responses")
    options: dict[str, Any] = {
        "temperature": temperature,
        "chunk_size": chunk_size,
        "entropy": entropy,
    }
    sampler = replayed_sampler(rollouts, temperature) if replay else None
    if packing:
        check_isolation(model, owner="score_responses")
        packed = pack(rollouts)
        if sequence is not None:
            lp, ent = _sequence_parallel_scores(model, packed, sequence, bf16, options, sampler)
            return packed.scatter(lp), None if ent is None else packed.scatter(ent)
        rule = _rule(sampler, packed.rows)
        with packed_attention(model, packed) as kwargs, _autocast(bf16, packed.keep):
            lp, ent = _token_scores(
                model, kwargs, packed.keep, packed.targets[None], **options, truncation=rule
            )
        return packed.scatter(lp[0]), None if ent is None else packed.scatter(ent[0])
    t, mask = rollouts.response_ids.shape[1], rollouts.attention_mask
    s = mask.shape[1]
    kwargs = {
        "input_ids": rollouts.input_ids,
        "attention_mask": mask.long(),
        "position_ids": position_ids(mask),
        "use_cache": False,
    }
    keep = torch.arange(s - t - 1, s - 1, device=mask.device)
    rows = torch.arange(len(rollouts), device=mask.device).repeat_interleave(t)
    rule = _rule(sampler, rows, real=rollouts.response_attention_mask.reshape(-1))
    with _autocast(bf16, keep):
        lp, ent = _token_scores(
            model, kwargs, keep, rollouts.response_ids, **options, truncation=rule
        )
    real = rollouts.response_attention_mask
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    return torch.where(real, lp, zero), None if ent is None else torch.where(real, ent, zero)


def replayed_sampler(rollouts: Rollouts, temperature: float) -> Tensor | None:
    """``rollouts.sampler`` when some row of it truncates (None otherwise: nothing to replay),
    after refusing a row sampled at another temperature than the trainer's (greedy rows count
    as T = 1, the temperature their log-probs were reported at)."""
    sampler = rollouts.sampler
    if sampler is None:
        return None
    recorded = sampler[:, 0]
    effective = torch.where(recorded == 0, 1.0, recorded)
    other = (effective != temperature).nonzero()
    if len(other):
        row = int(other[0])
        raise ValueError(
            f"score_responses: row {row} was sampled at temperature {float(recorded[row])} "
            f"(Rollouts.sampler), the trainer scores at temperature={temperature}; set "
            f"TrainConfig.temperature to the engine's SamplingParams.temperature "
            "(sampling replay scores the distribution the engine sampled from)"
        )
    top_k, top_p = sampler[:, 1], sampler[:, 2]
    truncates = (recorded != 0) & ((top_k > 0) | (top_p < 1))
    return sampler if bool(truncates.any()) else None


def _rule(sampler: Tensor | None, rows: Tensor, real: Tensor | None = None) -> Truncation | None:
    """The truncation rule of tokens of rows ``rows``, None without a sampler to replay;
    positions where ``real`` is False (response padding, scored 0) are left untruncated, so
    they cost nothing."""
    if sampler is None:
        return None
    rule = Truncation.of_rows(sampler, rows)
    if real is None:
        return rule
    return Truncation(torch.where(real, rule.top_k, 0), torch.where(real, rule.top_p, 1.0))


def _sequence_parallel_scores(
    model: nn.Module,
    packed: Any,
    group: Any,
    bf16: bool,
    options: dict,
    sampler: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """The ``(m)`` scores of ``packed``'s kept positions, this rank computing those in its
    slice (``rlblocks.models.ulysses``), every rank's gathered in ``keep``'s order."""
    from rlblocks.models import ulysses

    shard = ulysses.split(packed.input_ids, packed.position_ids, group)
    mine, local = shard.local(packed.keep)
    rule = _rule(sampler, packed.rows[mine])
    with ulysses.sequence_parallel(model, shard) as kwargs, _autocast(bf16, packed.keep):
        lp, ent = _token_scores(
            model, kwargs, local, packed.targets[mine][None], **options, truncation=rule
        )
    lp = ulysses.gather_at(lp[0], packed.keep, shard)
    return lp, None if ent is None else ulysses.gather_at(ent[0], packed.keep, shard)


def _autocast(bf16: bool, like: Tensor) -> contextlib.AbstractContextManager:
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=like.device.type, dtype=torch.bfloat16)


def _token_scores(
    model: nn.Module,
    kwargs: dict,
    keep: Tensor,
    targets: Tensor,
    *,
    temperature: float,
    chunk_size: int,
    entropy: bool,
    truncation: Truncation | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Scores ``(r k)`` of ``targets`` ``(r k)`` from the outputs at columns ``keep`` ``(k)`` of
    a forward with ``kwargs`` (``r`` rows: the batch, or 1 packed sequence); ``truncation``:
    the rule of each of the ``r·k`` tokens (row-major), or None."""
    head = _chunkable_head(model)
    if head is not None:
        scorer = _ScoringHead(head, targets, temperature, chunk_size, entropy, truncation)
        with _swapped(model, head, scorer):
            out: Tensor = model(**kwargs, logits_to_keep=keep).logits
        if out is scorer.result:
            # Read from the model's output, not the scorer: FSDP hooks the output tensors to
            # gather the parameters again before their backward.
            return out[..., 0], out[..., 1] if entropy else None
        _UNCHUNKABLE.add(type(_base(model)))  # the model changed its logits: not a plain head
    if _accepts_logits_to_keep(model):
        logits = model(**kwargs, logits_to_keep=keep).logits
    else:
        logits = model(**kwargs).logits[:, keep]
    if temperature != 1.0:
        logits = logits / temperature
    lp = token_logprobs(logits, targets, chunk_size=chunk_size, truncation=truncation)
    if not entropy:
        return lp, None
    if truncation is None:
        return lp, entropy_from_logits(logits, chunk_size=chunk_size)
    ent = entropy_from_logits(logits, chunk_size=chunk_size, truncation=truncation,
                              token_ids=targets)  # fmt: skip
    return lp, ent


_UNCHUNKABLE: set[type] = set()


def _base(model: nn.Module) -> nn.Module:
    # A peft wrapper's forward is (*args, **kwargs): look at the model it wraps.
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module


def _chunkable_head(model: nn.Module) -> nn.Linear | None:
    """The output layer to swap for :class:`_ScoringHead`, or None: it must be a plain
    ``nn.Linear`` (not a peft adapter layer), the model must take ``logits_to_keep`` and apply
    no soft-capping or scale after its head."""
    base = _base(model)
    if type(base) in _UNCHUNKABLE or not _accepts_logits_to_keep(model):
        return None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
    if not isinstance(head, nn.Linear):
        return None
    config: Any = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "final_logit_softcapping", None) is not None:
        return None
    if getattr(text, "logit_scale", None) not in (None, 1, 1.0):
        return None
    return head


class _ScoringHead(nn.Module):
    """Stands in for the output layer during one forward: hidden states ``(r k d)`` to the
    log-probs of ``targets`` ``(r k)`` (and entropies), returned as the model's "logits"
    ``(r k 1)`` (``(r k 2)`` with entropies), also kept on the module to check by identity
    that the model returned them untouched."""

    def __init__(
        self,
        head: nn.Linear,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        entropy: bool,
        truncation: Truncation | None = None,
    ) -> None:
        super().__init__()
        self.head = head
        self.targets, self.temperature = targets, temperature
        self.chunk_size, self.want_entropy = chunk_size, entropy
        self.truncation = truncation
        self.result: Tensor | None = None

    def forward(self, hidden: Tensor) -> Tensor:
        lead = hidden.shape[:-1]
        options: dict[str, Any] = {
            "temperature": self.temperature,
            "chunk_size": self.chunk_size,
            "entropy": self.want_entropy,
        }
        hidden, targets = hidden.reshape(-1, hidden.shape[-1]), self.targets.reshape(-1)
        weight, bias = self.head.weight, self.head.bias
        split = vocab_split(weight)
        if split is None:
            lp, ent = linear_token_scores(
                hidden, weight, bias, targets, **options, truncation=self.truncation
            )
        else:  # tensor parallel: this rank's vocabulary rows (rlblocks.trainer.tensor_parallel)
            if self.truncation is not None:  # every rank raises here, before any collective
                from torch.distributed.tensor import DTensor

                assert isinstance(weight, DTensor)  # vocab_split found its vocabulary rows
                raise ValueError(
                    "score_responses: sampling replay (Rollouts.sampler with top-k / top-p) "
                    "is not built for a vocabulary-sharded output layer (TrainConfig.tp = "
                    f"{weight.device_mesh.size()}): each rank holds only its rows of the "
                    "vocabulary; sample with SamplingParams(replay=False), or train with tp=1"
                )
            group, start = split
            local_bias = None if bias is None else _local(bias)
            lp, ent = vocab_parallel_token_scores(
                hidden,
                _local(weight),
                local_bias,
                targets,
                group=group,
                vocab_start=start,
                **options,
            )
        scores = [lp] if ent is None else [lp, ent]
        self.result = torch.stack([x.view(lead) for x in scores], dim=-1)  # not a view
        return self.result


@contextlib.contextmanager
def _swapped(model: nn.Module, head: nn.Module, scorer: nn.Module) -> Iterator[None]:
    """``scorer`` in place of ``head`` (found by identity among ``model``'s modules)."""
    name = next(n for n, m in _base(model).named_modules() if m is head)
    parent_name, _, leaf = name.rpartition(".")
    parent = _base(model).get_submodule(parent_name)
    setattr(parent, leaf, scorer)
    try:
        yield
    finally:
        setattr(parent, leaf, head)


def vocab_split(weight: Tensor) -> tuple[Any, int] | None:
    """``(group, first row)`` of an output-layer weight split by vocabulary rows over a 1-D
    device mesh (a ``Shard(0)`` DTensor: tensor parallelism), None for a whole weight."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return None
    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"score_responses: the output layer's weight is a DTensor placed "
            f"{tuple(weight.placements)} on a {weight.device_mesh.ndim}-D mesh; the scoring "
            "takes whole weights or vocabulary rows split over one mesh dimension (Shard(0))"
        )
    mesh = weight.device_mesh
    rows = -(-weight.shape[0] // mesh.size())  # torch.chunk's rows per rank
    return mesh.get_group(), mesh.get_local_rank() * rows


def _local(x: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return x.to_local() if isinstance(x, DTensor) else x


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    base = _base(model)
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False
