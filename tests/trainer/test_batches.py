"""Mini-batch order, advantage shapes and re-padding."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlblocks.interfaces import Advantages
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.batches import minibatch_rows, pad_columns, token_advantages


def test_minibatch_rows_counts_and_coverage():
    # 10 rows in mini-batches of 4 -> ⌈10 / 4⌉ = 3 pieces of 4, 4, 2 rows; 2 epochs -> 6.
    pieces = list(minibatch_rows(10, size=4, epochs=2, seed=(0, 0)))
    assert [len(p) for p in pieces] == [4, 4, 2, 4, 4, 2]
    for epoch in (pieces[:3], pieces[3:]):  # every epoch covers every row exactly once
        assert sorted(torch.cat(epoch).tolist()) == list(range(10))
    assert not torch.equal(torch.cat(pieces[:3]), torch.cat(pieces[3:]))  # reshuffled


def test_minibatch_rows_is_deterministic_and_ignores_global_rng():
    first = list(minibatch_rows(12, size=5, epochs=3, seed=(7, 2)))
    torch.manual_seed(123)
    torch.rand(10)
    again = list(minibatch_rows(12, size=5, epochs=3, seed=(7, 2)))
    other = list(minibatch_rows(12, size=5, epochs=3, seed=(7, 3)))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_single_minibatch_keeps_row_order():
    # Limit: one mini-batch per epoch is not shuffled (order would change nothing).
    for size in (None, 6, 9):
        pieces = list(minibatch_rows(6, size=size, epochs=2, seed=(0, 0)))
        assert [p.tolist() for p in pieces] == [list(range(6))] * 2


def test_token_advantages_shapes():
    ro = Rollouts.from_lists(
        [[1], [2, 3]], [[4, 5, 6], [7]], response_masks=[[True, False, True], [True]]
    )
    # (b) advantages [2, -1] broadcast over each row's valid tokens, 0 elsewhere:
    # row 0 mask [T, F, T] -> [2, 0, 2]; row 1 mask [T, F(pad), F(pad)] -> [-1, 0, 0].
    expected = torch.tensor([[2.0, 0.0, 2.0], [-1.0, 0.0, 0.0]])
    assert_close(token_advantages(torch.tensor([2.0, -1.0]), ro), expected)
    full = torch.tensor([[1.0, 9.0, 3.0], [4.0, 9.0, 9.0]])  # 9 = garbage at masked tokens
    assert_close(token_advantages(full, ro), torch.tensor([[1.0, 0.0, 3.0], [4.0, 0.0, 0.0]]))
    tup = Advantages(full, torch.zeros(2, 3))
    assert_close(token_advantages(tup, ro), token_advantages(full, ro))
    with pytest.raises(ValueError, match="advantages have shape"):
        token_advantages(torch.zeros(3), ro)


def test_pad_columns():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert_close(pad_columns(x, 4), torch.tensor([[1.0, 2.0, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0]]))
    assert pad_columns(x, 2) is not None and torch.equal(pad_columns(x, 2), x)
