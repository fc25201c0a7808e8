"""DAPO dynamic sampling: keep only the groups whose rewards are not all equal.

Yu et al. 2025, "DAPO", arXiv 2503.14476, §3.2, eq. 11: the batch is built from prompts with
0 < |{oᵢ : is_equivalent(a, oᵢ)}| < G. A group whose G samples are all right (or all wrong) has
zero group-relative advantage, so it adds no gradient and only dilutes the batch; the trainer
drops it and samples more prompts until the batch is full (the "over-sample and filter" loop
stays with the caller).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class GroupFilter(NamedTuple):
    """``keep``: (b) bool, True for rows of kept groups; ``metrics``: counts as floats."""

    keep: Tensor
    metrics: dict[str, float]


def keep_informative_groups(
    rewards: Tensor, group_ids: Tensor, /, *, eps: float = 1e-6
) -> GroupFilter:
    """Rows whose group's rewards are not all equal (DAPO dynamic sampling, eq. 11).

        keepᵢ = max_{j∈g(i)} r_j − min_{j∈g(i)} r_j > eps

    With 0/1 accuracy rewards this is exactly eq. 11's 0 < #correct < G. With shaped rewards
    (overlong penalties, format bonuses) any spread counts; pass the accuracy reward instead to
    filter on correctness alone, as verl's ``filter_groups.metric=acc`` does. ``eps`` ignores
    spreads that are rounding noise, which a std-normalized advantage would blow up to ±1.

    A group of one is always dropped: max − min = 0, and its group-relative advantage is 0 by
    our convention (docs/conventions.md), so it could never contribute a gradient. A group with
    a NaN reward is dropped too (NaN > eps is False).

    ``rewards``: (b) float; ``group_ids``: (b) int64, arbitrary and non-contiguous. Returns
    `GroupFilter(keep (b) bool, metrics)`; use ``rollouts.select(keep)``. Metrics:
    ``filter/groups_kept``, ``filter/groups_filtered``, ``filter/rows_kept``,
    ``filter/kept_fraction`` (of groups). No gradient (runs under no_grad).
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            "keep_informative_groups: rewards and group_ids must both be (b), got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}; pass one reward and one "
            "group id per row"
        )
    with torch.no_grad():
        _, group = torch.unique(group_ids, return_inverse=True)  # (b) -> 0..n_groups-1
        n_groups = int(group.max()) + 1 if len(group) else 0
        r = rewards.detach().float()
        low = torch.full((n_groups,), float("inf"), device=r.device)
        high = torch.full((n_groups,), float("-inf"), device=r.device)
        low = low.scatter_reduce(0, group, r, reduce="amin")
        high = high.scatter_reduce(0, group, r, reduce="amax")
        informative = (high - low) > eps  # (n_groups) bool; singletons give 0 > eps = False
        keep = informative[group]
    kept = int(informative.sum())
    metrics = {
        "filter/groups_kept": float(kept),
        "filter/groups_filtered": float(n_groups - kept),
        "filter/rows_kept": float(keep.sum()),
        "filter/kept_fraction": kept / n_groups if n_groups else 0.0,
    }
    return GroupFilter(keep, metrics)
