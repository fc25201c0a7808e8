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

Position ids follow the attention mask, ``position_ids = clamp(cumsum(mask) − 1, min=0)`` (as
verl's ``compute_position_id_with_mask``), so a left-padded prompt gets the same rotary
positions as the unpadded one. Padding columns get position 0 (left) or repeat the last position
(right); they are never attended to, and their scores are set to 0.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import Tensor, nn

from rlblocks.losses.entropy import entropy_from_logits, token_logprobs
from rlblocks.models.context import check_rows
from rlblocks.rollouts import Rollouts


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
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the response tokens under ``model``, chunked over tokens.

    logprobs_{i,k} = log softmax(z_{i,k})[y_{i,k}],  entropy_{i,k} = H(softmax(z_{i,k})), with z
    from :func:`response_logits` (temperature applied), computed by ``token_logprobs`` and
    ``entropy_from_logits`` at most ``chunk_size`` tokens at a time in float32. Both are 0 at
    response padding.

    Shapes: returns ``(b t)`` ``logprobs`` and ``(b t)`` ``entropy`` (``None`` unless
    ``entropy``), float32 (float64 for a float64 model). Both carry the gradient of the model's
    parameters when grad mode is on; nothing is detached here.
    """
    logits = response_logits(model, rollouts, temperature=temperature, bf16=bf16)
    real = rollouts.response_attention_mask
    logprobs = token_logprobs(logits, rollouts.response_ids, chunk_size=chunk_size)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(real, logprobs, zero)
    if not entropy:
        return logprobs, None
    return logprobs, torch.where(real, entropy_from_logits(logits, chunk_size=chunk_size), zero)


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    # A peft wrapper's forward is (*args, **kwargs): look at the model it wraps.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return "logits_to_keep" in inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return False
