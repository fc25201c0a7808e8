"""DAPO dynamic sampling filter (arXiv 2503.14476, eq. 11)."""

from __future__ import annotations

import pytest
import torch

from rlblocks.rewards.filters import keep_informative_groups


def reference(rewards: list[float], group_ids: list[int], eps: float) -> list[bool]:
    """For each row, collect its group's rewards and check that they are not all equal."""
    keep = []
    for gid in group_ids:
        group = [r for r, g in zip(rewards, group_ids) if g == gid]
        keep.append(max(group) - min(group) > eps)
    return keep


def test_hand_worked() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    group_ids = torch.tensor([7, 7, 3, 3, 42, 42, 9])
    keep, metrics = keep_informative_groups(rewards, group_ids)
    # Group 7: {1, 0}, spread 1 > eps: kept (one right, one wrong: 0 < 1 < 2 of eq. 11).
    # Group 3: {1, 1}, all right: filtered. Group 42: {0, 0}, all wrong: filtered.
    # Group 9: a group of one, spread 0: filtered.
    torch.testing.assert_close(keep, torch.tensor([True, True, False, False, False, False, False]))
    assert metrics == {
        "filter/groups_kept": 1.0,
        "filter/groups_filtered": 3.0,
        "filter/rows_kept": 2.0,
        "filter/kept_fraction": 0.25,  # 1 of 4 groups
    }


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_loop_on_shuffled_noncontiguous_ids(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 1, 2, 3, 4, 5, 8]  # two groups of one in every batch
    ids = torch.randperm(1000, generator=gen)[: len(sizes)] * 7 - 300  # arbitrary, some < 0
    group_ids = torch.cat([torch.full((n,), int(i)) for n, i in zip(sizes, ids)])
    rewards = torch.cat(
        [
            torch.randint(0, 2, (n,), generator=gen).float()  # 0/1 accuracy: many ties
            if k % 2
            else torch.randn(n, generator=gen) * (k % 3 != 0)  # continuous, or all zero
            for k, n in enumerate(sizes)
        ]
    )
    perm = torch.randperm(len(rewards), generator=gen)  # groups interleaved in the batch
    rewards, group_ids = rewards[perm], group_ids[perm]
    keep, metrics = keep_informative_groups(rewards, group_ids)
    expected = reference(rewards.tolist(), group_ids.tolist(), 1e-6)
    torch.testing.assert_close(keep, torch.tensor(expected))
    kept_groups = {g for g, k in zip(group_ids.tolist(), expected) if k}
    assert metrics["filter/groups_kept"] == len(kept_groups)
    assert metrics["filter/groups_filtered"] == len(sizes) - len(kept_groups)
    assert metrics["filter/rows_kept"] == sum(expected)


def test_limits() -> None:
    group_ids = torch.tensor([5, 5, 5, 2, 2])
    # All rewards equal: nothing is informative.
    keep, _ = keep_informative_groups(torch.ones(5), group_ids)
    assert not keep.any()
    # Every row its own group: all dropped (a group of one has no advantage to learn from).
    keep, metrics = keep_informative_groups(torch.arange(5.0), torch.arange(5) * 3)
    assert not keep.any() and metrics["filter/groups_filtered"] == 5.0
    # Spreads at or below eps are noise: 1e-7 is dropped, 1e-3 kept.
    rewards = torch.tensor([0.5, 0.5 + 1e-7, 0.5, 0.0, 1e-3])
    keep, _ = keep_informative_groups(rewards, group_ids)
    torch.testing.assert_close(keep, torch.tensor([False, False, False, True, True]))
    # eps = 0 keeps any difference at all, but never a group of equal rewards.
    keep, _ = keep_informative_groups(torch.tensor([0.0, 1e-7]), torch.tensor([1, 1]), eps=0.0)
    assert keep.all()
    keep, _ = keep_informative_groups(torch.ones(2), torch.tensor([1, 1]), eps=0.0)
    assert not keep.any()
    # The spread must exceed eps: a spread of exactly 0.5 with eps 0.5 is dropped.
    keep, _ = keep_informative_groups(torch.tensor([0.0, 0.5]), torch.tensor([1, 1]), eps=0.5)
    assert not keep.any()
    # A NaN reward drops its group.
    keep, _ = keep_informative_groups(torch.tensor([0.0, float("nan"), 0.0, 1.0]), group_ids[1:])
    torch.testing.assert_close(keep, torch.tensor([False, False, True, True]))


def test_empty_batch_and_shape_errors() -> None:
    keep, metrics = keep_informative_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert keep.shape == (0,) and keep.dtype == torch.bool
    assert metrics["filter/groups_kept"] == 0.0 and metrics["filter/kept_fraction"] == 0.0
    with pytest.raises(ValueError, match=r"\(b\)"):
        keep_informative_groups(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))


def test_mask_selects_rollouts(make_rollouts) -> None:
    ro = make_rollouts(["a", "b", "c", "d"], group_ids=[4, 9, 4, 9])
    keep, _ = keep_informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), ro.group_ids)
    kept = ro.select(keep)  # group 4 has {1, 0}: kept; group 9 has {1, 1}: dropped
    assert kept.completions == ["a", "c"]
    assert kept.group_ids.tolist() == [4, 4]
