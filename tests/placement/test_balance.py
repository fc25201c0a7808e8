"""The token-balanced split of a batch over data-parallel ranks, and gathering it back."""

import pytest
import torch

from rlblocks.placement.balance import balanced_partition, contiguous_partition, gather_rows


def test_longest_first_to_the_least_loaded_rank():
    # Lengths 9 1 5 5 4 2 over 2 ranks, longest first (ties: earlier row first):
    # 9 (row 0) -> r0 [9]; 5 (row 2) -> r1 [5]; 5 (row 3) -> r1 [10]; 4 (row 4) -> r0 [13];
    # 2 (row 5) -> r1 [12]; 1 (row 1) -> r1 [13]. Loads 13 / 13; rows sorted within a rank.
    assert balanced_partition([9, 1, 5, 5, 4, 2], 2) == [[0, 4], [1, 2, 3, 5]]


def test_split_by_rows_would_be_unbalanced_by_tokens():
    lengths = [100, 90, 80, 5, 4, 3, 2, 1]
    parts = balanced_partition(lengths, 2)
    loads = [sum(lengths[i] for i in rows) for rows in parts]
    halves = [sum(lengths[:4]), sum(lengths[4:])]  # a split by rows: 275 / 10
    assert max(loads) - min(loads) <= max(lengths)  # LPT's guarantee
    assert max(loads) - min(loads) < max(halves) - min(halves)
    assert sorted(i for rows in parts for i in rows) == list(range(8))


def test_every_rank_gets_a_row_when_there_are_enough():
    for b in range(4, 12):
        lengths = torch.randint(1, 50, (b,), generator=torch.Generator().manual_seed(b)).tolist()
        assert all(balanced_partition(lengths, 4))


def test_contiguous_partition_sizes_differ_by_at_most_one():
    assert contiguous_partition(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert contiguous_partition(2, 3) == [[0], [1], []]
    with pytest.raises(ValueError, match="parts"):
        contiguous_partition(3, 0)


def test_gather_puts_rows_back_in_order():
    values = torch.arange(6.0)[:, None] * torch.ones(1, 3)  # row i holds i
    index = balanced_partition([9, 1, 5, 5, 4, 2], 2)
    parts = [values[rows] for rows in index]
    torch.testing.assert_close(gather_rows(parts, index, 6), values)


def test_gather_ignores_padding_copies():
    # Rank 1 had no row of its own and ran a copy of row 0 (the FSDP padding rule).
    values = torch.tensor([[1.0], [2.0]])
    out = gather_rows([values, torch.tensor([[99.0]])], [[0, 1], [0]], 2)
    torch.testing.assert_close(out, values)
