"""`Rollouts`: the one batch type that flows between every block.

A batch of ``b`` sequences, each a prompt followed by a response::

    prompt_ids      (b tp)      int64  left-padded
    response_ids    (b t)       int64  right-padded
    attention_mask  (b tp+t)    bool   True = a real token (prompt or response), False = padding
    response_mask   (b t)       bool   True = a policy token that counts in the loss
    group_ids       (b)         int64  rows sampled from the same prompt share an id
    rollout_logprobs (b t)      float32 log-probs the engine sampled with, or None
    sampler         (b 3)       float64 (temperature, top_k, top_p) each row was sampled with,
                                or None: set by an engine asked for sampling replay
                                (``SamplingParams.replay``; rlblocks.losses.truncation)
    prompts, completions        list[str] of length b (decoded text; "" when not decoded)
    metadata                    list[dict] of length b (ground truth, data source, ...)
    extras                      dict[str, Tensor]: the user's own per-row tensors, carried
                                through split/select/concat, (b) or response-aligned (b t ...)

The quantities the blocks hand each other have fixed names and are typed fields, None until a
block fills them (``ro.replace(old_logprobs=lp)``): a misspelt name fails at once, not deep
inside a loss::

    old_logprobs    (b t) float   log π_old, the policy before this update
    ref_logprobs    (b t) float   log π_ref, the reference policy
    advantages      (b t) float   per-token advantages
    returns         (b t) float   value targets
    old_values      (b t) float   the critic's values before this update
    rewards         (b) or (b t)  rewards (outcome, or per token)

Provenance, stamped by the run's rollout source (`rlblocks.run.source`), None elsewhere::

    policy_version  (b) int64     the weight version that sampled the row (syncs before it)
    staleness       (b) int64     updates between those weights and the ones the row is
                                  trained from, set when the source hands the row out

``response_mask`` is stricter than the response part of ``attention_mask``: in a multi-turn
rollout the tool's observation tokens are real tokens (attended to) that the policy did not
generate, so they are False in ``response_mask``.

This module imports nothing else from rlblocks but `rlblocks.base.rollouts_checks` (its checks),
`rlblocks.base.rollouts_rows` (padding, row indices, `balanced_partition`) and, on first use
of ``to_records``, `rlblocks.base.rollouts_table`; none of them imports anything of rlblocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlblocks.base.rollouts_checks import (
    check_extra,
    check_no_counted_padding,
    check_parts_alike,
    derived,
    expect_bool,
    expect_dims,
    expect_dtype,
    expect_shape,
    shape_of,
)
from rlblocks.base.rollouts_rows import (
    balanced_partition,
    cat_padded,
    padded_lists,
    row_index,
)

__all__ = [
    "OPTIONAL_FIELDS",
    "ROW_FIELDS",
    "TOKEN_FIELDS",
    "Index",
    "Rollouts",
    "balanced_partition",  # defined in rlblocks.base.rollouts_rows
]

Index = Tensor | Sequence[int] | slice

#: Optional response-aligned (b t) float fields, carried and padded like ``rollout_logprobs``.
TOKEN_FIELDS = (
    "rollout_logprobs",
    "old_logprobs",
    "ref_logprobs",
    "advantages",
    "returns",
    "old_values",
)
#: Optional (b) int64 fields: where a row comes from (stamped by the run's rollout source).
ROW_FIELDS = ("policy_version", "staleness")
#: Every optional per-row tensor field: the token fields, ``rewards`` ((b) or (b t)) and the
#: row fields.
OPTIONAL_FIELDS = (*TOKEN_FIELDS, "rewards", *ROW_FIELDS)


@dataclass(eq=False)
class Rollouts:
    """A batch of prompts and sampled responses. See the module docstring for the fields."""

    prompt_ids: Tensor
    response_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    group_ids: Tensor
    rollout_logprobs: Tensor | None = None
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    metadata: list[dict[str, Any]] = field(default_factory=list)
    extras: dict[str, Tensor] = field(default_factory=dict)
    pad_token_id: int = 0
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    old_values: Tensor | None = None
    rewards: Tensor | None = None
    policy_version: Tensor | None = None
    staleness: Tensor | None = None
    sampler: Tensor | None = None

    def __post_init__(self) -> None:
        b = self.prompt_ids.shape[0] if self.prompt_ids.dim() > 0 else -1
        for name in ("prompts", "completions"):
            if not getattr(self, name):
                setattr(self, name, [""] * max(b, 0))
        if not self.metadata:
            self.metadata = [{} for _ in range(max(b, 0))]
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check shapes, dtypes and consistency; raise ``ValueError`` naming the field."""
        expect_dims("prompt_ids", self.prompt_ids, 2)
        expect_dims("response_ids", self.response_ids, 2)
        b, tp = self.prompt_ids.shape
        t = self.response_ids.shape[1]
        expect_dtype("prompt_ids", self.prompt_ids, integer=True)
        expect_dtype("response_ids", self.response_ids, integer=True)
        expect_shape("response_ids", self.response_ids, (b, t), "prompt_ids has b rows")
        expect_shape("attention_mask", self.attention_mask, (b, tp + t), "(b, tp + t)")
        expect_shape("response_mask", self.response_mask, (b, t), "like response_ids")
        expect_bool("attention_mask", self.attention_mask)
        expect_bool("response_mask", self.response_mask)
        expect_shape("group_ids", self.group_ids, (b,), "one id per row")
        expect_dtype("group_ids", self.group_ids, integer=True)
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None:
                expect_shape(name, value, (b, t), "like response_ids")
                expect_dtype(name, value, integer=False)
        if self.rewards is not None:
            if not isinstance(self.rewards, Tensor) or self.rewards.shape not in ((b,), (b, t)):
                raise ValueError(
                    f"Rollouts.rewards: has shape {shape_of(self.rewards)}, expected ({b},) or "
                    f"({b}, {t}); pass one reward per row, or one per response token"
                )
            expect_dtype("rewards", self.rewards, integer=False)
        for name in ROW_FIELDS:
            value = getattr(self, name)
            if value is not None:
                expect_shape(name, value, (b,), "one value per row")
                expect_dtype(name, value, integer=True)
        if self.sampler is not None:
            expect_shape("sampler", self.sampler, (b, 3), "(temperature, top_k, top_p) per row")
            expect_dtype("sampler", self.sampler, integer=False)
        check_no_counted_padding(self.response_mask, self.attention_mask[:, tp:])
        for name in ("prompts", "completions", "metadata"):
            n = len(getattr(self, name))
            if n != b:
                raise ValueError(
                    f"Rollouts.{name}: has {n} entries but the batch has {b} rows; give one "
                    "entry per row"
                )
        for name, value in self.extras.items():
            if name in OPTIONAL_FIELDS:
                raise ValueError(
                    f"Rollouts.extras[{name!r}]: {name} is a field of Rollouts, not an extra; "
                    f"set it with rollouts.replace({name}=...)"
                )
            check_extra(name, value, b, t)

    # ------------------------------------------------------------------ views
    @property
    def batch_size(self) -> int:
        """The number of rows (sequences), ``b``."""
        return self.prompt_ids.shape[0]

    def __len__(self) -> int:
        return self.batch_size

    @property
    def input_ids(self) -> Tensor:
        """Prompt and response concatenated, (b tp+t) int64."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def prompt_mask(self) -> Tensor:
        """(b tp) bool: real prompt tokens."""
        return self.attention_mask[:, : self.prompt_ids.shape[1]]

    @property
    def response_attention_mask(self) -> Tensor:
        """(b t) bool: real response tokens, observation tokens included."""
        return self.attention_mask[:, self.prompt_ids.shape[1] :]

    @property
    def response_lengths(self) -> Tensor:
        """(b) int64: number of real response tokens of each row."""
        return self.response_attention_mask.sum(-1)

    @property
    def num_tokens(self) -> int:
        """Real tokens (prompt + response) in the whole batch."""
        return int(self.attention_mask.sum())

    def replace(self, **changes: Any) -> Rollouts:
        """A copy with some fields replaced (validated again; the masks' values only when a
        mask is replaced)."""
        if "attention_mask" in changes or "response_mask" in changes:
            return dataclasses.replace(self, **changes)
        with derived():
            child = dataclasses.replace(self, **changes)
        if "_lengths" in self.__dict__ and "prompt_ids" not in changes:
            child._keep_lengths(self.__dict__["_lengths"])
        return child

    def with_extras(self, **tensors: Tensor) -> Rollouts:
        """A copy carrying more per-row tensors, e.g. ``ro.with_extras(advantages=adv)``."""
        return self.replace(extras={**self.extras, **tensors})

    # ------------------------------------------------------------------ data out
    def to_records(
        self, *, rewards: Tensor | None = None, advantages: Tensor | None = None
    ) -> list[dict[str, Any]]:
        """One dict per row: prompt, completion, token counts, reward, advantage, metadata
        (`rlblocks.base.rollouts_table.rollout_records`; ``rewards`` / ``advantages`` default to
        the batch's own fields)."""
        from rlblocks.base.rollouts_table import rollout_records

        return rollout_records(self, rewards=rewards, advantages=advantages)

    def to_pandas(self, *, rewards: Tensor | None = None, advantages: Tensor | None = None) -> Any:
        """`to_records` as a ``pandas.DataFrame``, one row per sequence."""
        import pandas as pd

        return pd.DataFrame(self.to_records(rewards=rewards, advantages=advantages))

    def to_dataset(self, *, rewards: Tensor | None = None, advantages: Tensor | None = None) -> Any:
        """`to_records` as a ``datasets.Dataset`` (``save_to_disk``, ``to_parquet``, the Hub)."""
        from datasets import Dataset

        return Dataset.from_list(self.to_records(rewards=rewards, advantages=advantages))

    # ------------------------------------------------------------------ row operations
    def known_lengths(self) -> tuple[list[int], list[int]] | None:
        """Each row's real prompt and response tokens as Python ints, or None when some row's
        real tokens are not one run (a prompt with a hole, say). Read from the masks in one
        transfer the first time, then kept with the batch and handed to the batches derived
        from it (``select``, ``trim``, ``to``, ``replace`` of other fields): a trainer step
        plans every micro-batch from one read (on a GPU, each read waits for the device)."""
        if "_lengths" not in self.__dict__:
            tp = self.prompt_ids.shape[1]
            prompt, response = self.prompt_mask.sum(-1), self.response_attention_mask.sum(-1)
            columns = torch.arange(self.attention_mask.shape[1], device=prompt.device)
            runs = (columns >= tp - prompt[:, None]) & (columns < tp + response[:, None])
            one_run = (runs == self.attention_mask).all(-1)
            table = torch.stack([prompt, response, one_run.long()]).tolist()
            lengths = (table[0], table[1]) if all(table[2]) else None
            self._keep_lengths(lengths)
        kept: tuple[list[int], list[int]] | None = self.__dict__["_lengths"]
        return kept

    def row_tokens(self) -> list[int]:
        """Each row's real tokens (prompt + response) as Python ints: from
        :meth:`known_lengths` when the rows are runs (no further read), else one read of the
        attention mask."""
        kept = self.known_lengths()
        if kept is None:
            return self.attention_mask.sum(-1).tolist()
        return [p + r for p, r in zip(*kept, strict=True)]

    def _keep_lengths(self, lengths: tuple[list[int], list[int]] | None) -> Rollouts:
        object.__setattr__(self, "_lengths", lengths)
        return self

    def _lengths_of(self, picked: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """The kept lengths of rows ``picked``, or None (none kept: not read yet, or not runs)."""
        lengths = self.__dict__.get("_lengths")
        if lengths is None:
            return None
        return [lengths[0][i] for i in picked], [lengths[1][i] for i in picked]

    def select(self, index: Index) -> Rollouts:
        """Rows picked by a bool mask (b), a list/tensor of row indices (any order) or a slice."""
        # A slice stays a slice (views, and no index read back); other indices become a tensor.
        b = self.batch_size
        rows: slice | Tensor
        if isinstance(index, slice):
            rows, picked = index, list(range(b)[index])
        else:
            rows, picked = row_index(index, b)
        kept = self._lengths_of(picked) if "_lengths" in self.__dict__ else None
        with derived():  # rows of a checked batch: its value checks hold
            child = self.replace(
                prompt_ids=self.prompt_ids[rows],
                response_ids=self.response_ids[rows],
                attention_mask=self.attention_mask[rows],
                response_mask=self.response_mask[rows],
                group_ids=self.group_ids[rows],
                **{name: _rows(getattr(self, name), rows) for name in OPTIONAL_FIELDS},
                sampler=_rows(self.sampler, rows),
                prompts=[self.prompts[i] for i in picked],
                completions=[self.completions[i] for i in picked],
                metadata=[self.metadata[i] for i in picked],
                extras={k: v[rows] for k, v in self.extras.items()},
            )
        return child._keep_lengths(kept) if "_lengths" in self.__dict__ else child

    def repeat(self, n: int) -> Rollouts:
        """Each row repeated ``n`` times in place (row 0 n times, then row 1, ...).

        Copies keep their row's group id, so repeating ``p`` prompts that carry ids ``0..p-1``
        gives ``p`` groups of ``n``.
        """
        if n < 1:
            raise ValueError(f"Rollouts.repeat: n={n}; use n >= 1")
        return self.select(torch.arange(self.batch_size).repeat_interleave(n))

    def split(self, *, rows: int | None = None, token_budget: int | None = None) -> list[Rollouts]:
        """Contiguous micro-batches, in order, so that ``Rollouts.concat(parts)`` is ``self``.

        ``rows``: at most that many rows each. ``token_budget``: at most that many real tokens
        (prompt + response) each; a row longer than the budget alone forms its own micro-batch.
        Both may be given; each micro-batch then satisfies both.
        """
        if rows is None and token_budget is None:
            raise ValueError("Rollouts.split: neither rows nor token_budget given; pass one")
        if rows is not None and rows < 1:
            raise ValueError(f"Rollouts.split: rows={rows}; use rows >= 1")
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"Rollouts.split: token_budget={token_budget}; use token_budget >= 1")
        bounds, start, used = [], 0, 0
        for i, length in enumerate(self.row_tokens()):
            full_rows = rows is not None and i - start >= rows
            over_budget = token_budget is not None and i > start and used + length > token_budget
            if full_rows or over_budget:
                bounds.append((start, i))
                start, used = i, 0
            used += length
        if self.batch_size:
            bounds.append((start, self.batch_size))
        return [self.select(slice(lo, hi)) for lo, hi in bounds]

    def trim(self) -> Rollouts:
        """Drop padding columns that no row uses (left of prompts, right of responses): from
        the kept lengths when the rows are runs (``known_lengths``, no read), else read from
        the masks."""
        tp = self.prompt_ids.shape[1]
        kept = self.__dict__.get("_lengths")
        if kept is not None:
            first, t = tp - max(kept[0], default=0), max(kept[1], default=0)
        else:
            prompt_used = self.prompt_mask.any(0).nonzero()
            first = int(prompt_used[0]) if len(prompt_used) else tp
            response_used = self.response_attention_mask.any(0).nonzero()
            t = int(response_used[-1]) + 1 if len(response_used) else 0
        with derived():  # unused columns dropped: the value checks still hold
            child = self.replace(
                prompt_ids=self.prompt_ids[:, first:],
                response_ids=self.response_ids[:, :t],
                attention_mask=torch.cat(
                    [self.prompt_mask[:, first:], self.response_attention_mask[:, :t]], dim=1
                ),
                response_mask=self.response_mask[:, :t],
                **{name: _columns(getattr(self, name), t) for name in OPTIONAL_FIELDS},
                extras={k: v if v.dim() == 1 else v[:, :t] for k, v in self.extras.items()},
            )
        return child._keep_lengths(kept) if "_lengths" in self.__dict__ else child

    def balanced_shares(self, parts: int) -> list[list[int]]:
        """Row indices for each of ``parts`` workers, balanced by real tokens (each sorted):
        :func:`balanced_partition` of the rows' lengths."""
        return balanced_partition(self.row_tokens(), parts)

    def to(self, device: torch.device | str) -> Rollouts:
        """All tensors moved to ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        with derived():  # the same values, moved
            child = self.replace(**moved, extras={k: v.to(device) for k, v in self.extras.items()})
        return (
            child._keep_lengths(self.__dict__["_lengths"]) if "_lengths" in self.__dict__ else child
        )

    # ------------------------------------------------------------------ construction
    @staticmethod
    def concat(parts: Sequence[Rollouts]) -> Rollouts:
        """Rows of all parts, in order; prompts re-padded on the left, responses on the right."""
        if not parts:
            raise ValueError("Rollouts.concat: no parts; pass at least one Rollouts")
        first = parts[0]
        tp = max(p.prompt_ids.shape[1] for p in parts)
        t = max(p.response_ids.shape[1] for p in parts)
        check_parts_alike(parts, (*OPTIONAL_FIELDS, "sampler"))
        present = [name for name in OPTIONAL_FIELDS if getattr(first, name) is not None]
        keys = set(first.extras)

        def cat(name: str, left: bool, width: int, value: float | bool = 0) -> Tensor:
            return cat_padded([getattr(p, name) for p in parts], width, left, value)

        pad = first.pad_token_id
        return Rollouts(
            prompt_ids=cat("prompt_ids", True, tp, pad),
            response_ids=cat("response_ids", False, t, pad),
            attention_mask=torch.cat(
                [
                    cat("prompt_mask", True, tp, False),
                    cat("response_attention_mask", False, t, False),
                ],
                dim=1,
            ),
            response_mask=cat("response_mask", False, t, False),
            group_ids=torch.cat([p.group_ids for p in parts]),
            **{name: cat(name, False, t) for name in present},
            # every part has a sampler or none does (checked above)
            sampler=None
            if first.sampler is None
            else torch.cat([p.sampler for p in parts if p.sampler is not None]),
            prompts=[s for p in parts for s in p.prompts],
            completions=[s for p in parts for s in p.completions],
            metadata=[m for p in parts for m in p.metadata],
            extras={k: cat_padded([p.extras[k] for p in parts], t, False, 0) for k in keys},
            pad_token_id=pad,
        )

    @classmethod
    def from_lists(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        *,
        pad_token_id: int = 0,
        response_masks: Sequence[Sequence[bool]] | None = None,
        rollout_logprobs: Sequence[Sequence[float]] | None = None,
        group_ids: Sequence[int] | Tensor | None = None,
        prompts: Sequence[str] | None = None,
        completions: Sequence[str] | None = None,
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rollouts:
        """Build a batch from ragged token lists (prompts left-padded, responses right-padded).

        ``response_masks`` defaults to every response token counting; ``group_ids`` to one
        group per row (``0..b-1``).
        """
        fields = padded_lists(
            prompt_ids,
            response_ids,
            pad_token_id=pad_token_id,
            response_masks=response_masks,
            rollout_logprobs=rollout_logprobs,
        )
        b = len(prompt_ids)
        return cls(
            **fields,  # prompt_ids, response_ids, the masks, rollout_logprobs
            group_ids=torch.arange(b) if group_ids is None else torch.as_tensor(group_ids),
            prompts=list(prompts or []),
            completions=list(completions or []),
            metadata=[dict(m) for m in metadata] if metadata is not None else [],
            pad_token_id=pad_token_id,
        )


# ---------------------------------------------------------------------- helpers
def _rows(x: Tensor | None, rows: slice | Tensor) -> Tensor | None:
    return None if x is None else x[rows]


def _columns(x: Tensor | None, t: int) -> Tensor | None:
    """The first ``t`` response columns of a (b t) field; a (b) field as it is."""
    return None if x is None or x.dim() == 1 else x[:, :t]
