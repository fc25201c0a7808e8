"""Group statistics over arbitrary int64 ids: rlblocks/advantage/groups.py."""

from __future__ import annotations

import math
import statistics

import torch
from torch.testing import assert_close

from rlblocks.advantage.groups import (
    group_index,
    group_max,
    group_mean,
    group_min,
    group_size,
    group_std,
    group_sum,
)

IDS = torch.tensor([7, 3, 7, 3, 9])  # groups {7: rows 0, 2}, {3: rows 1, 3}, {9: row 4}
VALUES = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0])


def test_hand_worked():
    # sizes: 7 -> 2, 3 -> 2, 9 -> 1
    assert group_size(IDS).tolist() == [2, 2, 2, 2, 1]
    # sums: 7 -> 1 + 3 = 4, 3 -> 2 + 6 = 8, 9 -> 5
    assert_close(group_sum(VALUES, IDS), torch.tensor([4.0, 8.0, 4.0, 8.0, 5.0]))
    # means: 7 -> 4 / 2 = 2, 3 -> 8 / 2 = 4, 9 -> 5
    assert_close(group_mean(VALUES, IDS), torch.tensor([2.0, 4.0, 2.0, 4.0, 5.0]))
    # unbiased std: 7 -> √(((1-2)² + (3-2)²) / 1) = √2; 3 -> √((4 + 4) / 1) = √8; 9 -> 0
    expected = torch.tensor([math.sqrt(2), math.sqrt(8), math.sqrt(2), math.sqrt(8), 0.0])
    assert_close(group_std(VALUES, IDS), expected)
    # biased std: 7 -> √(2 / 2) = 1; 3 -> √(8 / 2) = 2; 9 -> 0
    assert_close(group_std(VALUES, IDS, unbiased=False), torch.tensor([1.0, 2.0, 1.0, 2.0, 0.0]))
    assert_close(group_max(VALUES, IDS), torch.tensor([3.0, 6.0, 3.0, 6.0, 5.0]))
    assert_close(group_min(VALUES, IDS), torch.tensor([1.0, 2.0, 1.0, 2.0, 5.0]))


def test_weighted_mean_hand_worked():
    weights = torch.tensor([1, 2, 3, 0, 4])
    # 7 -> (1·1 + 3·3) / (1 + 3) = 10 / 4 = 2.5; 3 -> (2·2 + 0·6) / 2 = 2; 9 -> 5·4 / 4 = 5
    expected = torch.tensor([2.5, 2.0, 2.5, 2.0, 5.0])
    assert_close(group_mean(VALUES, IDS, weights=weights), expected)


def test_group_index_is_dense():
    index, n = group_index(IDS)
    # sorted unique ids [3, 7, 9] -> 3 is 0, 7 is 1, 9 is 2
    assert n == 3
    assert index.tolist() == [1, 0, 1, 0, 2]


def test_matches_loop_reference(batch):
    ids, values = batch.group_ids.tolist(), batch.rewards.tolist()
    weights = batch.mask.sum(-1).tolist()
    members: dict[int, list[int]] = {}
    for row, gid in enumerate(ids):
        members.setdefault(gid, []).append(row)
    size, mean, wmean, std, vmax, vmin = [], [], [], [], [], []
    for gid in ids:
        xs = [values[r] for r in members[gid]]
        ws = [weights[r] for r in members[gid]]
        size.append(len(xs))
        mean.append(sum(xs) / len(xs))
        wmean.append(sum(w * x for w, x in zip(ws, xs)) / sum(ws))
        std.append(statistics.stdev(xs) if len(xs) > 1 else 0.0)
        vmax.append(max(xs))
        vmin.append(min(xs))
    assert group_size(batch.group_ids).tolist() == size
    assert_close(group_mean(batch.rewards, batch.group_ids), torch.tensor(mean))
    weighted = group_mean(batch.rewards, batch.group_ids, weights=batch.mask.sum(-1))
    assert_close(weighted, torch.tensor(wmean))
    assert_close(group_std(batch.rewards, batch.group_ids), torch.tensor(std))
    assert_close(group_max(batch.rewards, batch.group_ids), torch.tensor(vmax))
    assert_close(group_min(batch.rewards, batch.group_ids), torch.tensor(vmin))


def test_limits():
    # equal values: mean exactly the value and std exactly 0. Summing five float32 copies of
    # 0.96752494573593140 and dividing by 5 does not give it back; the group mean must.
    same = torch.full((5,), 0.9675249457359314)
    assert not torch.equal(same.sum() / 5, same[0])  # the naive mean misses by an ulp
    one_group = torch.full((5,), 2)
    assert torch.equal(group_mean(same, one_group), same)
    assert torch.equal(group_std(same, one_group), torch.zeros(5))
    assert torch.equal(group_mean(same, IDS, weights=torch.arange(5)), same)
    # equal weights give the plain mean; all-zero weights fall back to it
    assert_close(group_mean(VALUES, IDS, weights=torch.full((5,), 3)), group_mean(VALUES, IDS))
    assert_close(group_mean(VALUES, IDS, weights=torch.zeros(5)), group_mean(VALUES, IDS))
    # one group holding everything: the plain batch statistics
    one = torch.full((5,), -4, dtype=torch.int64)
    assert_close(group_mean(VALUES, one), VALUES.mean().expand(5))
    assert_close(group_std(VALUES, one), VALUES.std().expand(5))
    # relabelling the ids changes nothing
    assert_close(group_std(VALUES, IDS * 1_000_003 - 10**12), group_std(VALUES, IDS))
