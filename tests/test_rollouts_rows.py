"""rlblocks.base.rollouts_rows: padding ragged lists, widening and joining padded tensors, checking
row indices, and sharing rows out over workers (`balanced_partition`)."""

import pytest
import torch
from torch.testing import assert_close

import rlblocks.rollouts
from rlblocks.base.rollouts_rows import (
    balanced_partition,
    cat_padded,
    pad_columns,
    padded_lists,
    ragged_tensor,
    row_index,
)


def test_balanced_partition_is_still_where_it_was():
    assert rlblocks.rollouts.balanced_partition is balanced_partition


# ---------------------------------------------------------------------- padding
def test_ragged_rows_go_left_or_right():
    rows = [[1, 2], [], [3]]
    assert ragged_tensor(rows, 3, True, 0, torch.long).tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 3]]
    assert ragged_tensor(rows, 3, False, 9, torch.long).tolist() == [
        [1, 2, 9],
        [9, 9, 9],
        [3, 9, 9],
    ]


def test_pad_columns_widens_2d_and_keeps_1d():
    x = torch.tensor([[1.0], [2.0]])
    assert_close(pad_columns(x, 3, True, 0.0), torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]]))
    assert_close(pad_columns(x, 2, False, -1.0), torch.tensor([[1.0, -1.0], [2.0, -1.0]]))
    per_row = torch.tensor([5, 6])
    assert pad_columns(per_row, 4, False, 0) is per_row


def test_cat_padded_joins_rows_of_different_widths():
    a, b = torch.tensor([[True]]), torch.tensor([[True, True]])
    assert cat_padded([a, b], 2, False, False).tolist() == [[True, False], [True, True]]


def test_padded_lists_hand_worked():
    # prompts [1, 2] and [3]: tp = 2, left-padded; responses [4] and [5, 6]: t = 2, right-padded
    fields = padded_lists(
        [[1, 2], [3]],
        [[4], [5, 6]],
        pad_token_id=0,
        response_masks=None,
        rollout_logprobs=[[-0.5], [-1.0, -2.0]],
    )
    assert fields["prompt_ids"].tolist() == [[1, 2], [0, 3]]
    assert fields["response_ids"].tolist() == [[4, 0], [5, 6]]
    assert fields["attention_mask"].tolist() == [
        [True, True, True, False],
        [False, True, True, True],
    ]
    assert fields["response_mask"].tolist() == [[True, False], [True, True]]
    assert_close(fields["rollout_logprobs"], torch.tensor([[-0.5, 0.0], [-1.0, -2.0]]))
    with pytest.raises(ValueError, match="row 1 has 2 response tokens but rollout_logprobs"):
        padded_lists([[1], [2]], [[4], [5, 6]], pad_token_id=0, response_masks=None,
                     rollout_logprobs=[[0.0], [0.0]])  # fmt: skip


# ---------------------------------------------------------------------- row indices
def test_row_index_takes_masks_lists_and_negative_indices():
    rows, picked = row_index(torch.tensor([True, False, True]), 3)
    assert rows.tolist() == picked == [0, 2]
    rows, picked = row_index([-1, 0], 3)
    assert rows.tolist() == picked == [2, 0]
    with pytest.raises(IndexError, match="row index out of range for a batch of 3"):
        row_index([3], 3)
    with pytest.raises(ValueError, match=r"bool mask has shape \(2,\), expected \(3,\)"):
        row_index(torch.tensor([True, False]), 3)


# ---------------------------------------------------------------------- balanced_partition
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
