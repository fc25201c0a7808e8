"""Rollouts as a table: one record per row, for pandas or a ``datasets.Dataset``.

``Rollouts.to_records()`` / ``to_pandas()`` / ``to_dataset()`` call `rollout_records`. Kept out
of ``rlblocks/rollouts.py`` to keep that file short; like it, this module imports nothing else
from rlblocks (it reads the batch's fields by name).

Columns, in order: ``group_id``, ``prompt`` (the decoded prompt), ``completion``,
``prompt_tokens`` and ``response_tokens`` (real tokens), ``policy_tokens`` (response tokens
that count in the loss), ``reward`` (a (b t) reward summed over the row), ``advantage`` (the
mean over the row's policy tokens; NaN for a row without one), then one column per metadata
key. A metadata key named like one of these columns becomes ``metadata.<key>`` (rb.data's
``keep=True`` puts the dataset's ``prompt`` there, next to the decoded one). A key missing from
some rows is None there.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["COLUMNS", "rollout_records"]

#: The fixed columns of `rollout_records` (``reward`` and ``advantage`` only when given).
COLUMNS = ("group_id", "prompt", "completion", "prompt_tokens", "response_tokens",
           "policy_tokens", "reward", "advantage")  # fmt: skip


def rollout_records(
    rollouts: Any, *, rewards: Tensor | None = None, advantages: Tensor | None = None
) -> list[dict[str, Any]]:
    """One dict per row of ``rollouts`` (module docstring).

    ``rewards`` (b) or (b t) and ``advantages`` (b t) or (b) default to the batch's own fields;
    without either there is no such column. Raises ``ValueError`` for a tensor whose first
    dimension is not b.
    """
    b = len(rollouts)
    rewards = rollouts.rewards if rewards is None else rewards
    advantages = rollouts.advantages if advantages is None else advantages
    per_row: dict[str, list[float]] = {}
    if rewards is not None:
        rewards = _rows(rewards, b, "rewards").float()
        per_row["reward"] = (rewards if rewards.dim() == 1 else rewards.sum(-1)).tolist()
    if advantages is not None:
        advantages = _rows(advantages, b, "advantages").float()
        if advantages.dim() == 1:
            per_row["advantage"] = advantages.tolist()
        else:
            mask = rollouts.response_mask.to(advantages.device)
            counts = mask.sum(-1).tolist()
            sums = (advantages * mask).sum(-1).tolist()
            per_row["advantage"] = [s / n if n else math.nan for s, n in zip(sums, counts)]
    keys = dict.fromkeys(k for m in rollouts.metadata for k in m)
    columns = {k: f"metadata.{k}" if k in COLUMNS else k for k in keys}
    prompt_tokens = rollouts.prompt_mask.sum(-1).tolist()
    response_tokens = rollouts.response_attention_mask.sum(-1).tolist()
    policy_tokens = rollouts.response_mask.sum(-1).tolist()
    group_ids = rollouts.group_ids.tolist()
    records = []
    for i in range(b):
        record = {
            "group_id": group_ids[i],
            "prompt": rollouts.prompts[i],
            "completion": rollouts.completions[i],
            "prompt_tokens": prompt_tokens[i],
            "response_tokens": response_tokens[i],
            "policy_tokens": policy_tokens[i],
            **{name: values[i] for name, values in per_row.items()},
        }
        meta = rollouts.metadata[i]
        record.update({column: meta.get(k) for k, column in columns.items()})
        records.append(record)
    return records


def _rows(x: Tensor, b: int, name: str) -> Tensor:
    x = torch.as_tensor(x).detach().cpu()
    if x.dim() not in (1, 2) or x.shape[0] != b:
        raise ValueError(
            f"Rollouts.to_records: {name} has shape {tuple(x.shape)}, expected ({b},) or "
            f"({b}, t); pass one value per row, or one per response token"
        )
    return x
