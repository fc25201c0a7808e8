"""Mini-batch order, advantage shapes and re-padding."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlblocks.interfaces import Advantages
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.batches import (
    in_batch_order,
    micro_batches,
    minibatch_rows,
    pad_columns,
    token_advantages,
)
from rlblocks.trainer.config import TrainConfig


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


def _lengths_batch() -> Rollouts:
    # prompts of 2, 1, 3, 2, 1 tokens; responses of 5, 1, 3, 1, 4 tokens
    prompts = [[1, 2], [3], [4, 5, 6], [7, 8], [9]]
    responses = [[1] * 5, [2], [3] * 3, [4], [5] * 4]
    return Rollouts.from_lists(prompts, responses)


def test_micro_batches_hold_rows_of_similar_length_and_lose_no_row():
    ro = _lengths_batch()
    parts, order = micro_batches(ro, TrainConfig(micro_batch_size=2))
    # Sorted by response length, then prompt length: rows 1 (1+1), 3 (1+2), 2 (3), 4 (4), 0 (5).
    assert order.tolist() == [1, 3, 2, 4, 0]
    assert [len(p) for p in parts] == [2, 2, 1]
    trimmed = [p.trim() for p in parts]
    # Each piece computes only its own widths: 2 + 1, then 3 + 4, then 2 + 5 columns.
    assert [p.input_ids.shape[1] for p in trimmed] == [3, 7, 7]
    padded = sum(p.input_ids.numel() for p in trimmed)
    in_order = sum(p.trim().input_ids.numel() for p in ro.split(rows=2))
    assert padded == 27 and in_order == 31  # in order: 2·7 + 2·6 + 5 tokens
    whole, none = micro_batches(ro, TrainConfig())
    assert none is None and len(whole) == 1 and whole[0] is ro


def test_in_batch_order_undoes_the_length_order():
    ro = _lengths_batch()
    _, order = micro_batches(ro, TrainConfig(micro_batch_tokens=7))  # the longest row: 7
    values = torch.arange(5.0)[order]  # row i's value is i, listed in piece order
    assert in_batch_order(values, order).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert in_batch_order(values, None) is values


def test_a_row_over_the_token_budget_is_refused_naming_it():
    ro = _lengths_batch()
    longest = int(ro.attention_mask.sum(-1).argmax())
    with pytest.raises(ValueError, match=rf"row {longest} has 7 tokens .* at least 7"):
        micro_batches(ro, TrainConfig(micro_batch_tokens=6))
    assert len(micro_batches(ro, TrainConfig(micro_batch_tokens=7))[0]) == 4  # 2+3, 6, 5, 7
