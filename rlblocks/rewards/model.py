"""`RewardModel`: a sequence-classification model (a trained reward model) as a `RewardFn`.

    rm = rb.rewards.RewardModel.from_pretrained("/models/my-rm", batch_size=16)
    rewards, metrics = rm(rollouts)                   # one float per row, (b) float32
    reward = rb.rewards.combine({rm: 1.0, rb.rewards.math_answer: 0.5})

**What the reward model reads.** A reward model was trained on conversations rendered with *its*
tokenizer and chat template, which need not be the policy's. Row ``i`` becomes:

1. a prompt: ``metadata[i][prompt_key]`` (``"messages"`` by default) when the row carries it,
   i.e. the prompt as it was given to the engine, chat messages or raw text
   (`prompts_in_metadata` puts it there); otherwise ``prompts[i]``, the text the policy saw,
   already rendered with the *policy's* chat template if its engine applied one;
2. a conversation: chat messages plus ``{"role": "assistant", "content": completions[i]}``,
   rendered with the reward model's chat template and tokenized without further special tokens
   (the template holds them). A text prompt is, with ``chat=True``, first wrapped as one user
   message and rendered the same way; with ``chat=False`` (the default) ``prompt + completion``
   is tokenized as it is, with the tokenizer's own special tokens (a BOS). Verbatim is right
   when the reward model reads the policy's own format (a reward model fine-tuned from the
   policy, OpenRLHF's set-up) and when neither uses a chat template.

So a chat policy scored by a reward model with another template needs its messages in the
metadata, and a raw-text policy scored by a chat reward model needs ``chat=True``. Rows scored
verbatim by a reward model that has a chat template are reported by one warning (per
instance), since that is the silent mistake. ``completions[i]`` is the decoded response without
special tokens: the policy's EOS is not in it, and the reward model's template ends the turn in
its own way.

**Length.** ``max_length`` defaults to the model's context (its config) or the tokenizer's
``model_max_length``, whichever is smaller. A longer row raises a ``ValueError`` that names it
(``overlong="error"``), or keeps its last ``max_length`` tokens (``overlong="truncate"``: the
end of the response, where the score is read, is kept; the start of the prompt goes) and is
counted in ``reward/truncated``.

**Batching and padding.** Rows are sorted by length and scored ``batch_size`` at a time, so
that rows of similar length share a batch. transformers' ``*ForSequenceClassification`` reads
each row's score at its rightmost token that is not ``config.pad_token_id``; it ignores the
attention mask for that. Rows are therefore padded with exactly that id, on the side the
tokenizer says (``tokenizer.padding_side``): on the right the real tokens keep positions
0…n−1 as without padding; on the left the position ids are counted from each row's first real
token. Either way a row's score is its unpadded score up to float rounding (tested). With
``packing`` (the default, for models whose head is ``model.score``, as every transformers
decoder's ``*ForSequenceClassification``) a batch's rows run as one sequence with attention
kept per row (``rlblocks.models.packing``) and each score is read from the head's output at
that same token, so nothing is padded. A model
whose config has no ``pad_token_id`` would refuse batches of more than one row: it gets the
tokenizer's padding token, else its EOS (TRL's rule), so a row that *ends* in that token is
scored at the token before it, batched or not.

**Scores.** The logit, or with several labels the ``label`` column, in float32; ``normalize``
maps raw scores to rewards (``torch.sigmoid``, ``lambda s: (s - 1.5) / 2.0``). Metrics:
``reward/mean`` (of the rewards), ``reward/raw_mean`` and ``reward/raw_std`` (of the raw
scores, population std), ``reward/truncated`` (rows cut).

**Devices and placement.** Inputs go to the device of the model's first parameter (the
embeddings, also with a ``device_map``); scores come back on the CPU. ``from_pretrained``
loads local folders only (nothing is downloaded) on CUDA when there is one. On Ray,
``placement.build("reward", RewardModel.from_pretrained, folder)`` puts it on its own role;
the handle splits a batch's rows over the role's workers (``__call__`` is ``Dispatch.ROWS``),
and with several workers ``reward/raw_std`` is their row-weighted mean, not the pooled std.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from rlblocks.interfaces import Dispatch, RewardOutput, dispatch
from rlblocks.models.packing import Packed, check_isolation, packed_attention

if TYPE_CHECKING:
    from rlblocks.data.dataset import PromptDataset
    from rlblocks.rollouts import Rollouts

__all__ = ["RewardModel", "prompts_in_metadata"]

logger = logging.getLogger(__name__)

#: ``model_max_length`` at or above this is transformers' "no limit given" placeholder.
_NO_LIMIT = 10**9


class RewardModel:
    """A sequence-classification model scoring each row's conversation (module docstring).

    ``model``: a Hugging Face ``*ForSequenceClassification`` (or any module whose output has
    ``logits`` (b labels) read at the rightmost token not equal to ``config.pad_token_id``);
    ``tokenizer``: the reward model's own tokenizer. ``batch_size``: rows per forward.
    ``max_length`` / ``overlong``: the length policy. ``chat``: wrap text prompts as a user
    message. ``prompt_key``: the metadata key holding the original prompt (None: never read).
    ``label``: the logit column to read when the model has several. ``normalize``: raw scores
    (b) to rewards (b). A tokenizer with more ids than the model's input embedding has rows
    is refused here (``ValueError``), not at the first forward.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        overlong: Literal["error", "truncate"] = "error",
        chat: bool = False,
        prompt_key: str | None = "messages",
        label: int | None = None,
        normalize: Callable[[Tensor], Tensor] | None = None,
        packing: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(
                f"RewardModel: batch_size must be >= 1, got {batch_size}; pass a positive count"
            )
        if overlong not in ("error", "truncate"):
            raise ValueError(
                f"RewardModel: overlong must be 'error' or 'truncate', got {overlong!r}; pass "
                "one of them"
            )
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size, self.overlong, self.chat = batch_size, overlong, chat
        self.prompt_key, self.normalize = prompt_key, normalize
        self.max_length = max_length or _default_max_length(model, tokenizer)
        self.label = _label(model, label)
        self.pad_token_id = _pad_token_id(model, tokenizer)
        _check_vocabulary(model, tokenizer, self.pad_token_id)
        self.packing = packing and isinstance(getattr(model, "score", None), nn.Linear)
        if self.packing:  # refuse a model that mixes packed rows before any scoring
            check_isolation(getattr(model, "base_model", model), owner="RewardModel")
        self.__name__ = "reward_model"  # what combine() names it
        self._warned_verbatim = False

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> RewardModel:
        """Load a reward model and its tokenizer from a local folder (nothing is downloaded).

        ``device``: default CUDA when torch sees one, else the CPU; a device torch does not see
        is refused before anything is read. ``dtype``: default bfloat16 on CUDA, float32
        elsewhere. ``kwargs`` go to the constructor.
        """
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from rlblocks.models import resolve_device

        device = resolve_device(device, owner="RewardModel.from_pretrained")

        path = Path(folder).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"RewardModel.from_pretrained: {str(folder)!r} is not a local folder; reward "
                "models are loaded from folders only (download one on a machine with network "
                "access, e.g. `huggingface-cli download NAME --local-dir FOLDER`, and pass FOLDER)"
            )
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, local_files_only=True
        )
        return cls(model.to(device), tokenizer, **kwargs)

    def __repr__(self) -> str:
        return (
            f"RewardModel({type(self.model).__name__} on {self.device}, batch_size="
            f"{self.batch_size}, max_length={self.max_length}, overlong={self.overlong!r})"
        )

    @property
    def device(self) -> torch.device:
        """Where inputs go: the device of the model's first parameter."""
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ RewardFn
    @dispatch(Dispatch.ROWS)
    def __call__(self, rollouts: Rollouts, /) -> RewardOutput:
        """One reward per row, (b) float32 on the CPU, and the metrics (module docstring)."""
        ids, truncated = self.encode(rollouts)
        raw = self.score_ids(ids)  # (b) float32
        rewards = raw if self.normalize is None else self.normalize(raw)
        if not isinstance(rewards, Tensor) or rewards.shape != raw.shape:
            raise ValueError(
                f"RewardModel: normalize must map the raw scores (b) = ({len(raw)},) to a tensor "
                f"of the same shape, got {type(rewards).__name__} "
                f"{tuple(getattr(rewards, 'shape', ()))}; return one score per row"
            )
        rewards = rewards.detach().float().cpu()
        empty = len(raw) == 0
        metrics = {
            "reward/mean": 0.0 if empty else float(rewards.mean()),
            "reward/raw_mean": 0.0 if empty else float(raw.mean()),
            "reward/raw_std": 0.0 if empty else float(raw.std(correction=0)),
            "reward/truncated": float(truncated),
        }
        return RewardOutput(rewards, metrics)

    # ------------------------------------------------------------------ the steps, public for debugging
    def render(self, rollouts: Rollouts) -> list[str]:
        """The text the reward model reads for each row (before truncation)."""
        return [self._render(rollouts, i)[0] for i in range(len(rollouts))]

    def encode(self, rollouts: Rollouts) -> tuple[list[list[int]], int]:
        """``(token ids of each row, number of rows truncated)``, the length policy applied."""
        rendered = [self._render(rollouts, i) for i in range(len(rollouts))]
        ids: list[list[int]] = [[] for _ in rendered]
        for templated in (True, False):  # one batched tokenizer call per kind
            rows = [i for i, (_, t) in enumerate(rendered) if t is templated]
            if rows:
                texts = [rendered[i][0] for i in rows]
                encoded = self.tokenizer(texts, add_special_tokens=not templated)["input_ids"]
                for i, row_ids in zip(rows, encoded, strict=True):
                    ids[i] = list(row_ids)
        truncated = 0
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(
                    f"RewardModel: row {i} is empty after tokenization; give every row a "
                    "prompt or a response"
                )
            if self.max_length is not None and len(row) > self.max_length:
                if self.overlong == "error":
                    raise ValueError(
                        f"RewardModel: row {i} has {len(row)} tokens (prompt + response as the "
                        f"reward model reads them), past max_length={self.max_length}; pass "
                        f"overlong='truncate' to keep its last {self.max_length} tokens, or "
                        "shorten the prompts / max_new_tokens"
                    )
                ids[i], truncated = row[-self.max_length :], truncated + 1
        return ids, truncated

    def score_ids(self, ids: Sequence[Sequence[int]]) -> Tensor:
        """Raw scores (b) float32 on the CPU of token-id rows, ``batch_size`` rows per
        forward, longest rows first."""
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        scores = torch.empty(len(ids), dtype=torch.float32)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            try:
                scores[rows] = self._forward([ids[i] for i in rows])
            except Exception as error:  # out of memory, an id past the vocabulary: say which rows
                raise RuntimeError(
                    f"RewardModel: scoring rows {rows} ({len(ids[rows[0]])} tokens the longest) "
                    f"on {self.device} failed: {error}; lower batch_size (or max_length) if "
                    "it ran out of memory"
                ) from error
        return scores

    @torch.inference_mode()
    def _forward(self, rows: list[Sequence[int]]) -> Tensor:
        """Raw scores of one batch, (b) float32 on the CPU: packed (:meth:`_forward_packed`) or
        padded."""
        if self.packing:
            return self._forward_packed(rows)
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, row in enumerate(rows):
            cols = slice(width - len(row), width) if left else slice(0, len(row))
            input_ids[k, cols] = torch.as_tensor(list(row), dtype=torch.long)
            mask[k, cols] = 1
        inputs = {"input_ids": input_ids, "attention_mask": mask}
        if left:  # real tokens at positions 0..n-1, as in the unpadded row
            inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        device = self.device
        logits = self.model(**{k: v.to(device) for k, v in inputs.items()}).logits  # (b labels)
        return logits[:, self.label].float().cpu()

    def _forward_packed(self, rows: list[Sequence[int]]) -> Tensor:
        """Raw scores of ``rows`` run as one packed sequence (``rlblocks.models.packing``): the
        head's per-token outputs are taken, by a hook on ``model.score``, at each row's last
        token that is not ``pad_token_id`` (the token transformers' pooling reads; the row's
        first when it is all padding), before the model pools them."""
        device = self.device
        lengths = torch.tensor([len(r) for r in rows])
        ends = lengths.cumsum(0)
        starts = ends - lengths
        ids = torch.tensor([token for row in rows for token in row], device=device)[None]
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[None].to(device)
        read = [_last_real(row, self.pad_token_id) for row in rows]
        last = (starts + torch.tensor(read)).to(device)
        packed = Packed(
            input_ids=ids,
            position_ids=positions,
            bounds=tuple(zip(starts.tolist(), ends.tolist(), strict=True)),
            keep=last,
            targets=ids[0, last],
            rows=torch.arange(len(rows), device=device),
            cols=torch.zeros(len(rows), dtype=torch.long, device=device),
            shape=(len(rows), 1),
        )
        outputs: list[Tensor] = []
        hook = self.model.score.register_forward_hook(lambda _m, _i, out: outputs.append(out))
        try:
            with packed_attention(self.model, packed) as kwargs:
                self.model(**kwargs)
        finally:
            hook.remove()
        return outputs[-1][0, last, self.label].float().cpu()

    def _render(self, rollouts: Rollouts, i: int) -> tuple[str, bool]:
        """``(text, templated)`` of row ``i`` (module docstring)."""
        meta = rollouts.metadata[i] if rollouts.metadata else {}
        given = meta.get(self.prompt_key) if self.prompt_key is not None else None
        prompt = rollouts.prompts[i] if given is None else given
        completion = rollouts.completions[i]
        if isinstance(prompt, str):
            if not self.chat:
                if given is None:
                    self._warn_verbatim(i)
                return prompt + completion, False
            messages: list[Mapping[str, Any]] = [{"role": "user", "content": prompt}]
        else:
            messages = _messages(prompt, i, self.prompt_key)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"RewardModel: row {i} is a chat conversation but the reward model's tokenizer "
                "has no chat template; set tokenizer.chat_template, or score text prompts "
                "verbatim (chat=False, no messages in the metadata)"
            )
        turns = [*messages, {"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(turns, tokenize=False), True

    def _warn_verbatim(self, i: int) -> None:
        if self._warned_verbatim or getattr(self.tokenizer, "chat_template", None) is None:
            return
        self._warned_verbatim = True
        logger.warning(
            "RewardModel: row %d has no metadata[%r], so the policy's rendered prompt plus the "
            "completion is scored verbatim, not re-rendered with the reward model's chat "
            "template. Right if the reward model reads the policy's format; otherwise put the "
            "prompts in the metadata (rb.rewards.prompts_in_metadata(dataset)), or pass "
            "chat=True for raw-text prompts.",
            i,
            self.prompt_key,
        )


def prompts_in_metadata(dataset: PromptDataset, *, key: str = "messages") -> PromptDataset:
    """A copy of ``dataset`` whose rows also carry their prompt in ``metadata[key]``.

    The engine copies metadata onto every rollout row, so a `RewardModel` can render the
    original messages with its own chat template instead of reading the policy's rendering.
    """
    from rlblocks.data.dataset import PromptDataset

    rows = [dataclasses.replace(r, metadata={**r.metadata, key: r.prompt}) for r in dataset]
    return PromptDataset(rows, dropped=dataset.dropped)


def _messages(prompt: Any, i: int, key: str | None) -> list[Mapping[str, Any]]:
    ok = isinstance(prompt, Sequence) and not isinstance(prompt, Mapping) and len(prompt) > 0
    if ok and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise TypeError(
        f"RewardModel: row {i}: metadata[{key!r}] must be raw text or a non-empty list of chat "
        f'messages [{{"role": ..., "content": ...}}], got {type(prompt).__name__}: '
        f"{prompt!r:.80}; fix that column of the data"
    )


def _default_max_length(model: Any, tokenizer: Any) -> int | None:
    from rlblocks.models.context import context_length  # here: rlblocks.models imports transformers

    limits = [context_length(model), getattr(tokenizer, "model_max_length", None)]
    known = [n for n in limits if isinstance(n, int) and 0 < n < _NO_LIMIT]
    return min(known) if known else None


def _label(model: Any, label: int | None) -> int:
    labels = getattr(model.config, "num_labels", 1)
    if label is None:
        if labels != 1:
            raise ValueError(
                f"RewardModel: the model has {labels} labels (config.num_labels); pass label=k "
                "to read logit column k as the score"
            )
        return 0
    if not 0 <= label < labels:
        raise ValueError(
            f"RewardModel: label={label} but the model has {labels} labels; pass label in "
            f"0..{labels - 1}"
        )
    return label


def _check_vocabulary(model: Any, tokenizer: Any, pad_token_id: int) -> None:
    """Refuse a tokenizer whose ids (or the padding id) run past the model's input embedding:
    a row holding such an id would fail in the forward, far from the cause (an index error on
    the CPU, a device-side assert on CUDA). Models without ``get_input_embeddings`` (any module
    with ``logits``) are not checked."""
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        return
    ids = len(tokenizer)
    if ids > rows:
        first = tokenizer.convert_ids_to_tokens(rows)
        raise ValueError(
            f"RewardModel: the tokenizer has {ids} token ids but the model's input embedding has "
            f"{rows} rows, so ids {rows}..{ids - 1} (the first: {first!r}) would index past it "
            "and fail in the forward; give the reward model the tokenizer it was trained with "
            "(RewardModel.from_pretrained loads both from one folder), or resize its embeddings "
            "(model.resize_token_embeddings(len(tokenizer))) and train the new rows"
        )
    if not 0 <= pad_token_id < rows:
        raise ValueError(
            f"RewardModel: the padding id {pad_token_id} is outside the model's input embedding "
            f"({rows} rows); set model.config.pad_token_id to an id below {rows}"
        )


def _pad_token_id(model: Any, tokenizer: Any) -> int:
    """``config.pad_token_id``, set first from the tokenizer (pad, else EOS) when missing."""
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(
            "RewardModel: neither the model's config nor its tokenizer names a padding or EOS "
            "token, so batches cannot be padded; set model.config.pad_token_id"
        )
    logger.info("RewardModel: the model's config has no pad_token_id; using %d", pad)
    config.pad_token_id = int(pad)
    return int(pad)


def _last_real(row: Sequence[int], pad_token_id: int | None) -> int:
    """Index of ``row``'s last token that is not ``pad_token_id`` (0 if there is none)."""
    for i in range(len(row) - 1, -1, -1):
        if row[i] != pad_token_id:
            return i
    return 0
