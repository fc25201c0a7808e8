"""Prompts to token ids: chat rendering, validation and left padding, shared by rollout engines.

A prompt is raw text, a list of chat messages (``[{"role": "user", "content": "..."}]``) or
a list of token ids.

* Messages are rendered with ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``
  and tokenized without adding special tokens (the template already holds any BOS).
* Raw text is used verbatim (tokenized with the tokenizer's special tokens, e.g. a BOS) unless
  ``chat=True``, which wraps it as one user message first. We do not guess from whether the
  tokenizer has a chat template: many base models ship one, and silently wrapping their prompts
  would change what the policy sees. This is TRL's split between "standard" and
  "conversational" prompts.
* ``chat=False`` forbids message lists (an error rather than a silent choice).
* Token ids (a non-empty list of ints) are used as they are, whatever ``chat`` says: the
  multi-turn agent rollout (`rlblocks.envs.AgentEngine`) hands an engine the conversation so far
  as ids, so that the tokens the model sampled in earlier turns are never decoded and
  re-tokenized (which can give other ids: "token in, token out" across turns). Every id must be
  in the tokenizer's vocabulary; the text of such a prompt is its decoding, special tokens kept.

Padding is done here, on the left, whatever ``tokenizer.padding_side`` says: generation appends
to the right end of every row, so the prompts must end in the same column.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence


def render_prompts(
    prompts: Sequence[Any],
    tokenizer: Any,
    *,
    chat: bool | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[list[str], list[list[int]]]:
    """The text the model sees and its token ids, one entry per prompt.

    ``prompts``: a non-empty list of strings, message lists and/or token-id lists. ``chat``: see
    the module docstring (None: strings verbatim, messages templated; True: strings wrapped as a
    user message; False: strings and ids only). ``tools``: JSON schemas of tools (the format of
    ``transformers.utils.get_json_schema``) passed to the chat template as ``tools=`` (templates
    that know tool calling describe them to the model; others ignore them). Returns
    ``(texts, ids)``: ``texts[i]`` the rendered prompt (without special tokens the tokenizer adds
    around raw text), ``ids[i]`` its token ids. Raises ``TypeError``/``ValueError`` naming the
    offending prompt.
    """
    if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Sequence):
        raise TypeError(
            f"render_prompts: prompts must be a list of prompts (strings or message lists), got "
            f"{type(prompts).__name__}; wrap a single prompt in a list"
        )
    if len(prompts) == 0:
        raise ValueError("render_prompts: prompts is empty; give at least one prompt")
    texts, ids = [], []
    for i, prompt in enumerate(prompts):
        if _is_token_ids(prompt):
            tokens = _checked_ids(i, prompt, tokenizer)
            texts.append(tokenizer.decode(tokens, skip_special_tokens=False))
            ids.append(tokens)
            continue
        text, templated = _render(i, prompt, tokenizer, chat, tools)
        _check_text(i, text)
        tokens = list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
        if not tokens:
            raise ValueError(
                f"render_prompts: prompt {i} is empty after tokenization; give every prompt at "
                "least one token"
            )
        texts.append(text)
        ids.append(tokens)
    return texts, ids


def _check_text(i: int, text: str) -> None:
    """Refuse a prompt that is not Unicode text: a lone surrogate (``"\\udcff"``, what
    ``bytes.decode(errors="surrogateescape")`` leaves for a byte that is not UTF-8) has no
    UTF-8 form, and the tokenizer failed on it with a ``TypeError`` that named no prompt."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"render_prompts: prompt {i} holds a lone surrogate ({text[error.start]!r} at "
            f"character {error.start}: {text[max(0, error.start - 20) : error.start + 20]!r}), "
            "which is not Unicode text and no tokenizer encodes; read its source with "
            "errors='replace' (or strip the character) and try again"
        ) from None


def left_pad(ids: Sequence[Sequence[int]], *, pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad ragged token lists: ``(input_ids (b tp) int64, attention_mask (b tp) bool)``."""
    rows = [torch.as_tensor(list(x), dtype=torch.long) for x in ids]
    input_ids = pad_sequence(
        rows, batch_first=True, padding_value=pad_token_id, padding_side="left"
    )
    mask = pad_sequence(
        [torch.ones(len(x), dtype=torch.bool) for x in rows],
        batch_first=True,
        padding_value=False,
        padding_side="left",
    )
    return input_ids, mask


def _is_token_ids(prompt: Any) -> bool:
    """A non-empty list (or tuple) of integers (bools are not ids)."""
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in prompt)
    )


def _checked_ids(i: int, prompt: Sequence[int], tokenizer: Any) -> list[int]:
    tokens = [int(x) for x in prompt]
    vocab = len(tokenizer)
    bad = next((x for x in tokens if not 0 <= x < vocab), None)
    if bad is not None:
        raise ValueError(
            f"render_prompts: prompt {i} is a list of token ids but holds {bad}, outside the "
            f"tokenizer's vocabulary of {vocab} ids; pass ids in 0..{vocab - 1}"
        )
    return tokens


def _render(
    i: int,
    prompt: Any,
    tokenizer: Any,
    chat: bool | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[str, bool]:
    """``(text, templated)`` for prompt ``i``."""
    if isinstance(prompt, str):
        if not chat:
            return prompt, False
        messages: list[Mapping[str, Any]] = [{"role": "user", "content": prompt}]
    else:
        messages = _messages(i, prompt)
        if chat is False:
            raise ValueError(
                f"render_prompts: prompt {i} is a list of chat messages but the engine was built "
                "with chat=False; build it with chat=True (or None), or pass raw strings"
            )
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"render_prompts: prompt {i} is a chat conversation but the tokenizer has no chat "
            "template; pass raw strings, or set tokenizer.chat_template"
        )
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, tools=list(tools) if tools else None
    )
    return text, True


def _messages(i: int, prompt: Any) -> list[Mapping[str, Any]]:
    ok = isinstance(prompt, Sequence) and not isinstance(prompt, Mapping)
    if ok and len(prompt) and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        return list(prompt)
    hint = " (one conversation is a list of messages: wrap it in a list)" * isinstance(
        prompt, Mapping
    )
    raise TypeError(
        f"render_prompts: prompt {i} is {type(prompt).__name__} {prompt!r:.80}{hint}; pass a "
        f'string, a non-empty list of messages [{{"role": ..., "content": ...}}] or a non-empty '
        "list of token ids"
    )


def check_metadata(
    metadata: Sequence[Mapping[str, Any]] | None, p: int, *, owner: str
) -> list[Mapping[str, Any]]:
    """One metadata mapping per prompt (empty ones when ``None``); a count mismatch raises."""
    if metadata is None:
        return [{} for _ in range(p)]
    if len(metadata) != p:
        raise ValueError(
            f"{owner}.generate: {len(metadata)} metadata entries for {p} prompts; pass one "
            "entry per prompt"
        )

    return list(metadata)
