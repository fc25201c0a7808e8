"""How many tokens a model can attend to, and the check every engine and trainer makes before
any compute.

A prompt longer than the model's context is not an error transformers raises: a RoPE model
simply runs on positions it never learned (and a long enough prompt asks for tens of GB of
attention memory before anything fails). So the lengths are checked first, against
`context_length` (the config's ``max_position_embeddings``, or the engine's own limit such as
vLLM's ``max_model_len``), and the error names the row, its lengths and what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Config fields that hold the context length, by model family (Llama/Qwen/Mistral, GPT-2, ...).
_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(model: Any) -> int | None:
    """The longest sequence ``model`` (a Hugging Face model, or its config) was built for, or
    None when its config does not say."""
    config = getattr(model, "config", model)
    if hasattr(config, "get_text_config"):  # multimodal configs nest the language model's
        config = config.get_text_config()
    for field in _FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_lengths(
    lengths: Sequence[int], *, new_tokens: int, limit: int | None, owner: str
) -> None:
    """Raise ``ValueError`` when a row's ``lengths[i] + new_tokens`` passes ``limit`` (None: no
    limit known, nothing checked). ``lengths``: prompt tokens per prompt (engines, with
    ``new_tokens`` = ``max_new_tokens``) or tokens per row (trainers, ``new_tokens`` = 0)."""
    if limit is None:
        return
    over = [i for i, n in enumerate(lengths) if n + new_tokens > limit]
    if not over:
        return
    i, n = over[0], lengths[over[0]]
    more = f" ({len(over) - 1} more rows too)" if len(over) > 1 else ""
    if new_tokens == 0:
        raise ValueError(
            f"{owner}: row {i} has {n} tokens, past the model's context of {limit}{more}; "
            f"limit the prompts (rb.data.limit_prompt_length) and max_new_tokens so that "
            f"prompt + response fits"
        )
    fix = (
        f"shorten or filter the prompts to at most {limit - new_tokens} tokens "
        f"(rb.data.limit_prompt_length(..., max_prompt_tokens={max(limit - new_tokens, 1)}, "
        f"overlong='truncate' or 'filter')) or lower max_new_tokens"
    )
    where = "is longer than" if n > limit else f"plus max_new_tokens={new_tokens} passes"
    raise ValueError(
        f"{owner}: prompt {i} has {n} tokens, which {where} the model's context of "
        f"{limit} tokens{more}; {fix}"
    )


def check_rows(model: Any, attention_mask: Any, *, owner: str) -> None:
    """`check_lengths` of a trainer's rows (``attention_mask`` (b s), True at real tokens)
    against ``model``'s context. A batch no wider than the context cannot hold a row past it,
    so in the usual case nothing is counted and no device value is read back to the host (a
    sync per forward on a GPU)."""
    limit = context_length(model)
    if limit is not None and attention_mask.shape[-1] > limit:
        check_lengths(attention_mask.sum(-1).tolist(), new_tokens=0, limit=limit, owner=owner)


__all__ = ["check_lengths", "check_rows", "context_length"]
