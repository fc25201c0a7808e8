"""Prompt length in tokens, and what to do with prompts longer than a limit.

A prompt is counted as the model will be fed it:

- raw text: ``tokenizer(text)["input_ids"]``, with the special tokens the tokenizer adds
  itself (a BOS for Llama-style tokenizers, nothing for Qwen);
- chat messages: ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``,
  the rendered text tokenized without further special tokens (the template has them).

``overlong="truncate"`` keeps the **end** of the prompt: the question and the instruction that
ends a prompt ("…How many apples does he have? Answer after ####.") matter more than the
start of a long context. For raw text the first tokens are cut; for chat messages the content
of the last user message is cut from its left, so the system message and the chat template
stay whole. Cut token ids are decoded back to text (the dataset holds text, not ids); because
re-tokenizing a decoded slice can merge differently, the cut is grown one token at a time
until the re-encoded prompt fits. A torn UTF-8 character at the cut is dropped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from rlblocks.data.dataset import PromptDataset, PromptRow
from rlblocks.interfaces import Prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Overlong", "limit_prompt_length", "prompt_token_ids"]

Overlong = Literal["error", "truncate", "filter"]
"""What `limit_prompt_length` does with a prompt over the limit."""


def prompt_token_ids(
    prompts: Sequence[Prompt], tokenizer: PreTrainedTokenizerBase
) -> list[list[int]]:
    """The token ids of each prompt as fed to the model (see the module docstring).

    ``prompts``: raw strings and/or chat-message lists, in any mix. Returns one list of ids per
    prompt, in order. Both kinds are tokenized in one batched call each.
    """
    text_at = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    chat_at = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    ids: list[list[int]] = [[] for _ in prompts]
    if text_at:
        encoded = tokenizer([prompts[i] for i in text_at])["input_ids"]
        for i, row_ids in zip(text_at, encoded, strict=True):
            ids[i] = list(row_ids)
    if chat_at:
        rendered = tokenizer.apply_chat_template(
            [list(prompts[i]) for i in chat_at],  # type: ignore[arg-type]  # chat messages: transformers types them dict[str, str]
            add_generation_prompt=True,
            tokenize=False,
        )
        encoded = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        for i, row_ids in zip(chat_at, encoded, strict=True):
            ids[i] = list(row_ids)
    return ids


def limit_prompt_length(
    dataset: PromptDataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_tokens: int,
    overlong: Overlong = "error",
) -> PromptDataset:
    """Enforce ``len(prompt_token_ids(prompt)) ≤ max_prompt_tokens`` on every row.

    ``overlong``:
      - ``"error"``: raise ``ValueError`` naming the first long row's source index, its length
        and the limit (and how many rows are long);
      - ``"truncate"``: keep the last tokens of each long prompt (module docstring), warn;
      - ``"filter"``: drop long rows, warn, and record their source indices in
        ``dataset.dropped`` (``num_dropped`` counts them).

    Returns a new `PromptDataset`; the input is not modified.
    """
    if max_prompt_tokens < 1:
        raise ValueError(
            f"limit_prompt_length: max_prompt_tokens must be >= 1, got {max_prompt_tokens}; "
            "pass a positive limit"
        )
    if overlong not in ("error", "truncate", "filter"):
        raise ValueError(
            f"limit_prompt_length: overlong must be 'error', 'truncate' or 'filter', got "
            f"{overlong!r}; pass one of them"
        )
    lengths = [len(ids) for ids in prompt_token_ids(dataset.prompts, tokenizer)]
    long = [k for k, n in enumerate(lengths) if n > max_prompt_tokens]
    if not long:
        return dataset
    if overlong == "error":
        first = long[0]
        raise ValueError(
            f"limit_prompt_length: row {dataset[first].index}: prompt is {lengths[first]} "
            f"tokens, longer than max_prompt_tokens={max_prompt_tokens} ({len(long)} of "
            f"{len(dataset)} rows are too long); pass overlong='truncate' or 'filter'"
        )
    if overlong == "filter":
        dropped = [dataset[k].index for k in long]
        message = f"dropped {len(long)} of {len(dataset)} prompts longer than {max_prompt_tokens}"
        more = "..." if len(dropped) > 10 else ""
        warnings.warn(f"{message} tokens (source rows {dropped[:10]}{more})", stacklevel=2)
        kept = [row for k, row in enumerate(dataset) if lengths[k] <= max_prompt_tokens]
        return PromptDataset(kept, dropped=[*dataset.dropped, *dropped])
    rows = list(dataset)  # overlong == "truncate"
    for k in long:
        rows[k] = _truncate(rows[k], tokenizer, max_prompt_tokens)
    message = f"truncated {len(long)} of {len(dataset)} prompts to their last {max_prompt_tokens}"
    warnings.warn(f"{message} tokens", stacklevel=2)
    return PromptDataset(rows, dropped=dataset.dropped)


def _truncate(row: PromptRow, tokenizer: PreTrainedTokenizerBase, limit: int) -> PromptRow:
    """The row with its prompt cut from the left to fit ``limit`` tokens."""
    if isinstance(row.prompt, str):
        text = _keep_tail(row.prompt, lambda content: content, tokenizer, limit, row.index)
        return replace(row, prompt=text)
    messages = [dict(m) for m in row.prompt]
    users = [j for j, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError(
            f"limit_prompt_length: row {row.index}: cannot truncate a chat prompt with no user "
            "message; pass overlong='filter' to drop such rows"
        )
    last = users[-1]

    def with_content(content: str) -> list[dict[str, Any]]:
        return [*messages[:last], {**messages[last], "content": content}, *messages[last + 1 :]]

    content = _keep_tail(messages[last]["content"], with_content, tokenizer, limit, row.index)
    return replace(row, prompt=with_content(content))


def _keep_tail(
    content: str,
    build: Callable[[str], Prompt],
    tokenizer: PreTrainedTokenizerBase,
    limit: int,
    index: int,
) -> str:
    """The longest suffix of ``content`` (in whole tokens) for which ``build(suffix)`` fits."""

    def length(text: str) -> int:
        return len(prompt_token_ids([build(text)], tokenizer)[0])

    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    # Start from the suffix the token count says should fit, then shrink if merges disagree.
    keep = min(len(ids) - 1, len(ids) - (length(content) - limit))
    while keep > 0:
        tail = tokenizer.decode(ids[len(ids) - keep :], clean_up_tokenization_spaces=False)
        tail = tail.lstrip("\ufffd")  # type: ignore[union-attr]  # transformers types decode() str | list[str]
        if tail and length(tail) <= limit:
            return tail
        keep -= 1
    raise ValueError(
        f"limit_prompt_length: row {index}: cannot truncate the prompt to {limit} tokens: "
        f"without its text it is already {length('')} tokens (the system message and "
        "template); pass a larger max_prompt_tokens, or overlong='filter'"
    )
