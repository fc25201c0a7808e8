"""Supervised fine-tuning data: token ids with a mask of the tokens the loss trains on.

    data = rb.data.sft_data("chats.jsonl", tokenizer, max_tokens=1024)
    for batch in rb.data.SFTBatches(data, batch_size=8, seed=0, epochs=3):
        logs = policy.step(batch, zeros, loss_fn=nll)     # batch: a Rollouts

An SFT batch is a `rlblocks.rollouts.Rollouts` like an RL batch: the prompt in ``prompt_ids``
(left-padded), the target in ``response_ids`` (right-padded), ``response_mask`` True exactly on
the tokens trained on, ``group_ids = arange(b)``, ``metadata[i] = {"index": source row}``.

Two row layouts (TRL's names), chosen per dataset by the columns present; a source with a
``messages`` column is conversational whatever other columns it has (UltraChat has ``prompt``
and ``messages``):

- **conversational**: ``messages``, a list of ``{"role", "content"}`` dicts. Every assistant
  turn is trained on. The prompt is the conversation up to the first assistant turn, rendered
  with ``add_generation_prompt=True``; the response is the rest, up to the end of the last
  assistant turn (later messages are left out: they would train nothing).
- **prompt / completion**: ``prompt`` text or messages, ``completion`` text or assistant
  message(s). Text and text: the prompt is tokenized as raw text, as an RL engine feeds it
  (`rlblocks.data.length.prompt_token_ids`: with the tokenizer's own special tokens, a BOS for
  Llama), the completion without special tokens and followed by the EOS token, trained on, so
  that the model learns to stop. Messages and messages (or text, taken as one assistant
  message): rendered as a conversation whose trained turns are the completion's assistant turns.

Choices made here:

- **Prefix rendering.** A conversation is rendered with ``apply_chat_template(tokenize=False)``
  at each turn boundary: ``messages[:k]`` with the generation prompt before assistant turn
  ``k``, ``messages[:k+1]`` without it after; each rendering must be a text prefix of the next
  (else ``ValueError``: the template is not prefix-stable, e.g. it rewrites earlier turns).
  The differences are the segments, tokenized one by one without special tokens and
  concatenated. A trained segment is the whole rendered assistant message after its header:
  its content, the end-of-turn token and whatever the template writes after it (ChatML's
  ``"<|im_end|>\\n"``, as TRL's assistant-only masks); headers and other turns are not trained.
- **The prompt is the RL prompt**: ``prompt_ids`` is ``prompt_token_ids([prompt])[0]``, the
  ids an RL engine would start generating from, so SFT and a later RL stage see one format.
- **Length** (``max_tokens``, prompt + response): ``"error"`` names the first long row;
  ``"truncate"`` cuts the end of the response (and then any untrained tokens left at its end),
  so a cut response has no end-of-turn token; ``"filter"`` drops the row (``SFTData.dropped``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from rlblocks.data.dataset import _Kept
from rlblocks.data.length import Overlong, prompt_token_ids
from rlblocks.data.prompts import Source, _text, _unicode, _value, read_rows
from rlblocks.interfaces import Prompt
from rlblocks.rollouts import Rollouts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["SFTData", "SFTExample", "sft_data"]


class SFTExample(NamedTuple):
    """One tokenized example: prompt ids, response ids and the response's trained-token mask."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[bool]
    """One per response token; True = the loss trains on it (assistant tokens)."""
    index: int  # type: ignore[assignment]  # the field shadows tuple.index (a public name, kept)
    """Row index in the source, for error messages and ``Rollouts.metadata``."""


class SFTData(_Kept[SFTExample]):
    """A list of `SFTExample` with the tokenizer that made them, and the source rows dropped."""

    _noun = "examples"

    def __init__(
        self,
        examples: Iterable[SFTExample],
        tokenizer: PreTrainedTokenizerBase,
        *,
        dropped: Sequence[int] = (),
    ) -> None:
        self.examples = list(examples)
        self.tokenizer = tokenizer
        self.dropped = tuple(dropped)  # source indices of rows removed by overlong="filter"

    def _items(self) -> list[SFTExample]:
        return self.examples

    def _sliced(self, items: list[SFTExample]) -> SFTData:
        return SFTData(items, self.tokenizer, dropped=self.dropped)

    def rollouts(self, indices: Sequence[int] | None = None) -> Rollouts:
        """The examples at ``indices`` (positions in this dataset; all if None) as one batch.

        Padded with the tokenizer's pad token (its EOS if it has none, else 0: padding is never
        attended to); ``group_ids = arange(b)``; ``metadata[i] = {"index": source row}``;
        ``prompts`` decoded with special tokens, ``completions`` without (as the engines do).
        """
        picked = self.examples if indices is None else [self.examples[i] for i in indices]
        if not picked:
            raise ValueError("SFTData.rollouts: no examples to batch; pick at least one")
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id
        pad = tokenizer.eos_token_id if pad is None else pad
        prompts = [ex.prompt_ids for ex in picked]
        responses = [ex.response_ids for ex in picked]
        return Rollouts.from_lists(
            prompts,
            responses,
            pad_token_id=0 if pad is None else pad,
            response_masks=[ex.response_mask for ex in picked],
            group_ids=torch.arange(len(picked)),
            prompts=tokenizer.batch_decode(prompts, skip_special_tokens=False),
            completions=tokenizer.batch_decode(responses, skip_special_tokens=True),
            metadata=[{"index": ex.index} for ex in picked],
        )


def sft_data(
    source: Source,
    tokenizer: PreTrainedTokenizerBase,
    *,
    messages: str = "messages",
    prompt: str = "prompt",
    completion: str = "completion",
    max_tokens: int | None = None,
    overlong: Overlong = "error",
) -> SFTData:
    """Tokenize an SFT dataset (the module docstring says how each layout is rendered).

    Args:
        source: ``.parquet`` / ``.jsonl`` / ``.json`` / ``.csv`` path, a Dataset, or dicts.
        tokenizer: the policy's tokenizer; conversations need its chat template, text
            completions its EOS token.
        messages: the column of chat messages (conversational layout, used if present).
        prompt, completion: the columns of the prompt / completion layout.
        max_tokens: limit on ``len(prompt_ids) + len(response_ids)``; None: no limit.
        overlong: ``"error"``, ``"truncate"`` (cut the response's end, warn) or ``"filter"``
            (drop the row, warn, record its source index in ``dropped``).

    Returns an `SFTData`. Raises ``ValueError`` naming the file, line (or row) and column for
    a malformed row: no assistant turn, an empty completion, a message without str ``role`` /
    ``content``, a conversation starting with the assistant, a chat template that is not
    prefix-stable; naming the columns there are when neither layout's columns are.
    """
    if overlong not in ("error", "truncate", "filter"):
        raise ValueError(
            f"sft_data: overlong must be 'error', 'truncate' or 'filter', got {overlong!r}; pass "
            "one of them"
        )
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(
            f"sft_data: max_tokens must be >= 2 (a prompt and a response token), got "
            f"{max_tokens}; pass a larger limit, or None"
        )
    rows, columns = read_rows(source, columns=[], optional=[messages, prompt, completion])
    if messages in columns:
        plans = [
            _conversation(
                _value(row, rows.where(i), messages), 0, rows.where(i), messages, tokenizer
            )
            for i, row in enumerate(rows)
        ]
    elif prompt in columns and completion in columns:
        plans = [
            _prompt_completion(row, rows.where(i), prompt, completion, tokenizer)
            for i, row in enumerate(rows)
        ]
    else:
        raise ValueError(
            f"sft_data: {rows.origin()}no SFT columns: expected {messages!r} (chat messages) or "
            f"{prompt!r} and {completion!r}, available columns: {columns}; name yours with "
            "messages=..., prompt=..., completion=..."
        )
    examples = _tokenize(plans, tokenizer)
    if max_tokens is None:
        return SFTData(examples, tokenizer)
    return _limit(examples, [plan.where for plan in plans], tokenizer, max_tokens, overlong)


# ---------------------------------------------------------------------- one row
class _Plan(NamedTuple):
    """A row before tokenization: the RL prompt, and the response as (text, trained) pieces."""

    prompt: Prompt
    segments: list[tuple[str, bool]]
    eos: int | None  # a token appended, trained (the EOS after a text completion)
    where: str


def _prompt_completion(
    row: Mapping[str, Any],
    where: str,
    prompt: str,
    completion: str,
    tokenizer: PreTrainedTokenizerBase,
) -> _Plan:
    question, answer = _value(row, where, prompt), _value(row, where, completion)
    if not isinstance(question, list):
        if isinstance(answer, list):
            raise ValueError(  # noqa: TRY004 -- bad data in a row is always a ValueError
                f"sft_data: {where}: column {prompt!r} is text but {completion!r} holds chat "
                "messages; "
                "give the prompt as messages too ([{'role': 'user', 'content': ...}])"
            )
        question, answer = _text(question, where, prompt), _text(answer, where, completion)
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"sft_data: {where}: a text completion needs an EOS token after it (the model "
                "must learn "
                "to stop), and the tokenizer has none; set tokenizer.eos_token"
            )
        return _Plan(question, [(answer, True)], tokenizer.eos_token_id, where)
    head = _messages(question, where, prompt)
    if isinstance(answer, list):
        tail = _messages(answer, where, completion)
        if tail[0]["role"] != "assistant":
            raise ValueError(
                f"sft_data: {where}, column {completion!r}: the completion must start with an "
                f"assistant message, got role {tail[0]['role']!r}; put the assistant reply first"
            )
    else:
        tail = [{"role": "assistant", "content": _text(answer, where, completion)}]
    return _conversation([*head, *tail], len(head), where, completion, tokenizer, checked=True)


def _conversation(
    value: Any,
    start: int,
    where: str,
    column: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    checked: bool = False,
) -> _Plan:
    """A conversation trained on its assistant turns from message ``start`` on."""
    chat = value if checked else _messages(value, where, column)
    turns = [k for k in range(start, len(chat)) if chat[k]["role"] == "assistant"]
    if not turns:
        roles = [m["role"] for m in chat]
        raise ValueError(
            f"sft_data: {where}, column {column!r}: no assistant turn to train on (roles "
            f"{roles}); give every conversation at least one assistant message"
        )
    if turns[0] == 0:
        raise ValueError(
            f"sft_data: {where}, column {column!r}: the conversation starts with an assistant "
            "turn; put a prompt (a system or user message) before it"
        )
    if tokenizer.chat_template is None:
        raise ValueError(
            f"sft_data: {where}, column {column!r}: chat messages need a chat template, and the "
            "tokenizer has none; set tokenizer.chat_template"
        )
    return _Plan(chat[: turns[0]], _segments(chat, turns, where, tokenizer), None, where)


def _messages(value: Any, where: str, column: str) -> list[dict[str, Any]]:
    """Checked chat messages, each without the keys that hold None (a Dataset adds them)."""
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"sft_data: {where}, column {column!r}: expected a non-empty list of chat messages, "
            f"got {value!r:.80}; fix that row"
        )
    out = []
    for j, message in enumerate(value):
        if isinstance(message, Mapping):
            message = {k: v for k, v in message.items() if v is not None}
        content = message.get("content", "") if isinstance(message, dict) else None
        has_content = isinstance(message, dict) and (
            "content" in message or "tool_calls" in message
        )
        if not (has_content and isinstance(message.get("role"), str) and isinstance(content, str)):
            raise ValueError(
                f"sft_data: {where}, column {column!r}, message {j}: expected a dict with str "
                f"'role' and 'content', got {message!r:.80}; fix that message"
            )
        _unicode(content, where, column)
        if message["role"] == "assistant" and not content.strip() and "tool_calls" not in message:
            raise ValueError(
                f"sft_data: {where}, column {column!r}, message {j}: the assistant turn is "
                "empty; fill it in, or drop the row"
            )
        out.append(message)
    return out


def _segments(
    chat: list[dict[str, Any]], turns: list[int], where: str, tokenizer: PreTrainedTokenizerBase
) -> list[tuple[str, bool]]:
    """The response after the prompt as text pieces, cut where each assistant turn starts and
    ends; a piece is trained if it is an assistant turn."""

    def render(k: int, generation: bool) -> tuple[str, str]:
        name = f"messages[:{k}]" + (" with the generation prompt" if generation else "")
        text = tokenizer.apply_chat_template(
            chat[:k], add_generation_prompt=generation, tokenize=False
        )
        return text, name  # type: ignore[return-value]  # tokenize=False: transformers gives a str

    segments: list[tuple[str, bool]] = []
    done = render(turns[0], True)  # the prompt
    for k in turns:
        if k != turns[0]:  # the turns in between and the generation prompt: not trained
            header = render(k, True)
            segments.append((_after(done, header, where), False))
            done = header
        turn = render(k + 1, False)  # assistant turn k, its end-of-turn token and what follows
        segments.append((_after(done, turn, where), True))
        done = turn
    return segments


def _after(before: tuple[str, str], after: tuple[str, str], where: str) -> str:
    """``after``'s text past ``before``'s, which must be a prefix of it; each is (text, name)."""
    (old, old_name), (new, new_name) = before, after
    if not new.startswith(old):
        at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        raise ValueError(
            f"sft_data: {where}: the chat template is not prefix-stable: the rendering of "
            f"{new_name} does not start with that of {old_name} (they differ at character {at}: "
            f"{old[at : at + 30]!r} vs {new[at : at + 30]!r}), so the tokens of each turn "
            "cannot be told apart; use a tokenizer whose template renders each turn after the "
            "previous ones"
        )
    return new[len(old) :]


# ---------------------------------------------------------------------- tokens
def _tokenize(plans: list[_Plan], tokenizer: PreTrainedTokenizerBase) -> list[SFTExample]:
    """The plans' ids; every segment tokenized on its own, all in one batched call."""
    prompt_ids = prompt_token_ids([plan.prompt for plan in plans], tokenizer)
    texts = [text for plan in plans for text, _ in plan.segments]
    pieces = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    examples = []
    for index, (plan, prompt) in enumerate(zip(plans, prompt_ids, strict=True)):
        response: list[int] = []
        mask: list[bool] = []
        for _, trained in plan.segments:
            ids = list(next(pieces))
            response += ids
            mask += [trained] * len(ids)
        if plan.eos is not None:
            response.append(plan.eos)
            mask.append(True)
        if not any(mask):
            raise ValueError(
                f"sft_data: {plan.where}: the assistant turns render to no tokens; check the "
                "chat template"
            )
        examples.append(SFTExample(prompt, response, mask, index))
    return examples


def _limit(
    examples: list[SFTExample],
    wheres: list[str],
    tokenizer: PreTrainedTokenizerBase,
    max_tokens: int,
    overlong: Overlong,
) -> SFTData:
    """Enforce ``len(prompt_ids) + len(response_ids) ≤ max_tokens`` (`sft_data`'s overlong)."""
    lengths = [len(ex.prompt_ids) + len(ex.response_ids) for ex in examples]
    long = [k for k, n in enumerate(lengths) if n > max_tokens]
    if not long:
        return SFTData(examples, tokenizer)
    if overlong == "error":
        k = long[0]
        raise ValueError(
            f"sft_data: {wheres[k]}: prompt + response is {lengths[k]} tokens "
            f"({len(examples[k].prompt_ids)} + {len(examples[k].response_ids)}), longer than "
            f"max_tokens={max_tokens} ({len(long)} of {len(examples)} rows are too long); pass "
            "overlong='truncate' or 'filter'"
        )
    if overlong == "filter":
        dropped = [examples[k].index for k in long]
        more = "..." if len(dropped) > 10 else ""
        warnings.warn(
            f"dropped {len(long)} of {len(examples)} SFT examples longer than {max_tokens} "
            f"tokens (source rows {dropped[:10]}{more})",
            stacklevel=3,
        )
        kept = [ex for ex, n in zip(examples, lengths, strict=True) if n <= max_tokens]
        return SFTData(kept, tokenizer, dropped=dropped)
    examples = list(examples)  # overlong == "truncate"
    for k in long:
        prompt, response, mask, index = examples[k]
        keep = max(max_tokens - len(prompt), 0)
        while keep > 0 and not mask[keep - 1]:  # untrained tokens at the end train nothing
            keep -= 1
        if keep == 0:
            raise ValueError(
                f"sft_data: {wheres[k]}: the prompt is {len(prompt)} tokens, and no trained response "
                f"token fits within max_tokens={max_tokens}; pass overlong='filter' or a "
                "larger limit"
            )
        examples[k] = SFTExample(prompt, response[:keep], mask[:keep], index)
    warnings.warn(
        f"truncated the responses of {len(long)} of {len(examples)} SFT examples to fit "
        f"{max_tokens} tokens (a cut response has no end-of-turn token)",
        stacklevel=3,
    )
    return SFTData(examples, tokenizer)
