"""Splitting a call over the workers of a group, and gathering the answers back in order."""

import pytest
import torch

from rlblocks.placement.scatter import contiguous_partition, gather_rows
from rlblocks.rollouts import balanced_partition


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
