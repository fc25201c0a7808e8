"""The shared update loop's bookkeeping: each rank's share of a plan, and what a trainer gets."""

import pytest
import torch
from dp_cases import LOSS, make_batch, make_trainer

from rlblocks.rollouts import Rollouts
from rlblocks.trainer.parallel import share
from rlblocks.trainer.update import assign


def rows_of_length(*lengths: int) -> Rollouts:
    """One prompt token and ``length - 1`` response tokens per row: row i has ``lengths[i]``."""
    return Rollouts.from_lists([[1]] * len(lengths), [[2] * (n - 1) for n in lengths])


def test_each_rank_takes_its_balanced_piece_of_every_minibatch():
    batch = rows_of_length(9, 2, 5, 5, 4, 3)
    plan = [torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5]), torch.tensor([5, 0, 2, 1])]
    # mini-batch 1, rows 0 2 4 (9 5 4 tokens): 9 -> r0, 5 -> r1, 4 -> r1 (5 < 9)
    # mini-batch 2, rows 1 3 5 (2 5 3): 5 (row 3) -> r0, 3 (row 5) -> r1, 2 (row 1) -> r1
    # mini-batch 3, rows 5 0 2 1 (3 9 5 2): 9 (row 0) -> r0, 5 (row 2) -> r1, 3 (row 5) -> r1,
    #   2 (row 1) -> r1 (8 < 9); each piece keeps the mini-batch's own order of its rows
    zero, one = share(batch, plan, rank=0, size=2), share(batch, plan, rank=1, size=2)
    assert zero.rows == [0, 3] and one.rows == [1, 2, 4, 5]
    assert [zero.rows[i] for p in zero.plan for i in p.tolist()] == [0, 3, 0]
    assert [[one.rows[i] for i in p.tolist()] for p in one.plan] == [[2, 4], [1, 5], [5, 2, 1]]
    # A row is owned by the rank that first trains on it: every row by exactly one rank.
    assert zero.owned.tolist() == [True, True]
    assert one.owned.tolist() == [True, True, True, True]


def test_a_row_that_moves_between_ranks_is_counted_once():
    batch = rows_of_length(4, 4, 4, 4)
    plan = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([1, 0])]  # row 0: r0, then r1
    pieces = [share(batch, plan, rank=r, size=2) for r in range(2)]
    owned = [row for p in pieces for row, mine in zip(p.rows, p.owned.tolist()) if mine]
    assert sorted(owned) == [0, 1, 2, 3]
    assert pieces[1].rows == [0, 1, 3]  # row 0 reaches rank 1 in the third mini-batch only


def test_a_minibatch_smaller_than_the_group_is_refused():
    with pytest.raises(ValueError, match="a mini-batch of 1 rows cannot feed 2 data-parallel"):
        share(rows_of_length(3, 3), [torch.tensor([0])], rank=0, size=2)


def test_one_process_trains_on_everything():
    trainer = make_trainer(mini_batch_size=3, epochs=2)
    ro, _ = make_batch()
    work = assign(trainer, ro)
    assert len(work.batch) == len(ro) and bool(work.owned.all())
    assert sorted(torch.cat(work.plan).tolist()) == sorted(list(range(8)) * 2)
    # token_mean's normalizer is each whole mini-batch's valid-token count
    counts = [ro.response_mask[p].sum() for p in work.plan]
    assert torch.equal(torch.stack(work.norms), torch.stack(counts).to(work.norms[0].dtype))


def test_an_empty_batch_names_the_trainer():
    trainer = make_trainer()
    ro, advantages = make_batch()
    with pytest.raises(ValueError, match="PolicyTrainer.step: empty batch"):
        trainer.step(ro.select([]), advantages[:0], loss_fn=LOSS)
