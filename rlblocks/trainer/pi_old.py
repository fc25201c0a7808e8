"""π_old taken from the update's own forward, and the engine-versus-trainer mismatch metric.

When an update is one optimizer step over all of a rank's rows (one epoch, one mini-batch:
the recipes' default) and no π_old is given, no weight moves before any row's forward, so the
detached log-probs of that forward are π_old: the ratio is exactly 1, as in a plain on-policy
loop or TRL with one iteration, and the scoring pass before the update is skipped. The rows
carry their index (an extra, `ROW`) through the micro-batches so that each micro-batch's
log-probs can be put back in place afterwards, for the mismatch metric.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rlblocks.losses.mismatch import mismatch_metrics, mismatch_sums
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.update import Assignment

ROW = "_rlblocks_row"  # the extra that numbers the rows of an update taking π_old in it


def from_update(work: Assignment) -> bool:
    """True when the update is one optimizer step over all of this rank's rows: no weight
    changes before any row's forward, so each forward's log-probs are π_old."""
    if len(work.plan) != 1:
        return False
    rows = work.plan[0].sort().values
    return torch.equal(rows, torch.arange(len(work.batch), device=rows.device))


def numbered(batch: Rollouts) -> Rollouts:
    """``batch`` with each row's index in ``extras[ROW]``."""
    rows = torch.arange(len(batch), device=batch.response_ids.device)
    return batch.replace(extras={**batch.extras, ROW: rows})


def gathered(batch: Rollouts, seen: list[tuple[Tensor, Tensor]]) -> Rollouts:
    """``batch`` with ``old_logprobs`` put together from each micro-batch's ``(rows, lp)``
    (``lp`` trimmed to the micro-batch's longest response)."""
    old = torch.zeros(batch.response_ids.shape, dtype=seen[0][1].dtype, device=seen[0][1].device)
    for rows, lp in seen:
        old[rows, : lp.shape[1]] = lp
    return batch.replace(old_logprobs=old * batch.response_mask)


def mismatch(dp: Any, batch: Rollouts) -> dict[str, float]:
    """Engine versus trainer on the sampled tokens: π_old against the rollout log-probs
    (``rlblocks.losses.mismatch``), over the rows of every rank of ``dp``; {} without them.
    When some row is stale (``batch.staleness`` > 0 on any rank), the same metrics by
    staleness too: ``mismatch/s{j}/…`` over the rows sampled j updates before π_old."""
    if batch.rollout_logprobs is None:
        return {}
    assert batch.old_logprobs is not None  # the update has set π_old (prepare_update, gathered)
    metrics = _reduced(dp, batch.old_logprobs, batch.rollout_logprobs, batch.response_mask)
    oldest = -1 if batch.staleness is None or not len(batch) else int(batch.staleness.max())
    oldest = int(dp.all_max(float(oldest)))  # every rank takes part in every group's reduction
    if oldest <= 0:
        return metrics
    for j in range(oldest + 1):
        rows = batch.staleness == j if batch.staleness is not None else None
        mask = batch.response_mask if rows is None else batch.response_mask & rows[:, None]
        group = _reduced(dp, batch.old_logprobs, batch.rollout_logprobs, mask)
        if not math.isnan(group["mismatch/kl"]):  # no token of this staleness anywhere
            metrics |= {k.replace("mismatch/", f"mismatch/s{j}/"): v for k, v in group.items()}
    return metrics


def _reduced(dp: Any, old: Tensor, rollout: Tensor, mask: Tensor) -> dict[str, float]:
    sums = mismatch_sums(old, rollout, mask)
    # counts and sums add up over ranks, the max is a max
    largest = dp.all_max(float(sums[-1]))
    sums = torch.cat([dp.all_sum(sums[:-1]), sums.new_tensor([largest])])
    return mismatch_metrics(sums.cpu())
