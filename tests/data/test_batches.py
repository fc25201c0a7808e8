"""Tests for rlblocks.data.batches: order, epochs, and exact resume from a state dict."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from rlblocks.data import PromptBatches, PromptDataset, PromptRow


def _dataset(n: int) -> PromptDataset:
    return PromptDataset(
        PromptRow(prompt=f"p{i}", ground_truth=str(i), metadata={"ground_truth": str(i)}, index=i)
        for i in range(n)
    )


def _indices(batches, steps: int) -> list[list[int]]:
    return [[row.index for row in batch.rows] for batch in itertools.islice(batches, steps)]


# ---------------------------------------------------------------------- hand-worked orders
def test_unshuffled_drop_last():
    # 5 rows, 2 per step: [0 1] [2 3], row 4 is left over, then the next epoch starts again.
    batches = PromptBatches(_dataset(5), prompts_per_step=2, shuffle=False)
    assert _indices(batches, 5) == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    assert batches.steps_per_epoch == 2


def test_unshuffled_keep_last():
    # drop_last=False: the third batch of each epoch is the single row 4.
    batches = PromptBatches(_dataset(5), prompts_per_step=2, shuffle=False, drop_last=False)
    assert _indices(batches, 4) == [[0, 1], [2, 3], [4], [0, 1]]
    assert batches.steps_per_epoch == 3


def test_epoch_and_step_labels():
    batches = PromptBatches(_dataset(5), prompts_per_step=2, shuffle=False, drop_last=False)
    labels = [(b.epoch, b.step) for b in itertools.islice(batches, 5)]
    assert labels == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


def test_batch_is_ready_for_generate():
    batch = next(PromptBatches(_dataset(4), prompts_per_step=2, shuffle=False))
    assert batch.prompts == ["p0", "p1"] and len(batch) == 2
    assert batch.metadata == [{"ground_truth": "0"}, {"ground_truth": "1"}]
    assert batch.ground_truths == ["0", "1"]


# ---------------------------------------------------------------------- shuffling
def test_shuffle_reference_loop():
    n, p, seed = 10, 3, 7
    batches = PromptBatches(_dataset(n), prompts_per_step=p, seed=seed)
    # Reference: each epoch e visits permutation(n) of a generator seeded with (seed, e) and
    # yields its first 3 full batches; the 10th row of the order is skipped (drop_last).
    expected = []
    for epoch in range(4):
        order = np.random.default_rng([seed, epoch]).permutation(n).tolist()
        expected += [order[k : k + p] for k in range(0, n - p + 1, p)]
    assert _indices(batches, 12) == expected


def test_each_epoch_is_a_permutation_and_epochs_differ():
    batches = PromptBatches(_dataset(12), prompts_per_step=4, seed=0, drop_last=False)
    epochs = [list(itertools.chain(*_indices(batches, 3))) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(12))
    assert epochs[0] != epochs[1] != epochs[2]


def test_same_seed_same_batches_other_seed_other_batches():
    a = _indices(PromptBatches(_dataset(20), prompts_per_step=4, seed=3), 10)
    b = _indices(PromptBatches(_dataset(20), prompts_per_step=4, seed=3), 10)
    c = _indices(PromptBatches(_dataset(20), prompts_per_step=4, seed=4), 10)
    assert a == b and a != c


# ---------------------------------------------------------------------- resume
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 7])
def test_resume_gives_the_same_next_batches(stop_after, drop_last):
    # 7 rows, 3 per step: with drop_last an epoch is 2 steps, so stopping after 2 and 4 steps
    # saves exactly at an epoch boundary, after 1, 3 and 7 mid-epoch; without drop_last an
    # epoch is 3 steps (the last has 1 row) and step 3 is the boundary.
    def make():
        return PromptBatches(_dataset(7), prompts_per_step=3, seed=11, drop_last=drop_last)

    uninterrupted = _indices(make(), stop_after + 6)
    first = make()
    assert _indices(first, stop_after) == uninterrupted[:stop_after]
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint survives JSON
    resumed = make()
    resumed.load_state_dict(state)
    assert _indices(resumed, 6) == uninterrupted[stop_after:]


def test_state_dict_hand_worked():
    batches = PromptBatches(_dataset(7), prompts_per_step=3, seed=11)
    _indices(batches, 3)  # epoch 0: rows 0-2, 3-5; epoch 1: rows 0-2 of its order
    assert batches.state_dict() == {
        "epoch": 1,
        "position": 3,
        "seed": 11,
        "num_rows": 7,
        "prompts_per_step": 3,
        "shuffle": True,
        "drop_last": True,
    }


def test_resume_refuses_other_settings():
    state = PromptBatches(_dataset(7), prompts_per_step=3, seed=11).state_dict()
    with pytest.raises(ValueError, match="saved num_rows=7, this one has 8"):
        PromptBatches(_dataset(8), prompts_per_step=3, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="saved seed=11, this one has 12"):
        PromptBatches(_dataset(7), prompts_per_step=3, seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match="position 9 outside 0..7"):
        PromptBatches(_dataset(7), prompts_per_step=3, seed=11).load_state_dict(
            {"epoch": 0, "position": 9}
        )


# ---------------------------------------------------------------------- limits
def test_epochs_stop_the_iteration():
    batches = PromptBatches(_dataset(7), prompts_per_step=3, epochs=2)
    assert len(batches) == 4 and len(list(batches)) == 4
    assert list(batches) == []  # exhausted stays exhausted
    with pytest.raises(TypeError, match="endless"):
        len(PromptBatches(_dataset(7), prompts_per_step=3))


def test_one_batch_per_epoch_when_p_equals_n():
    batches = PromptBatches(_dataset(4), prompts_per_step=4, seed=0)
    epochs = _indices(batches, 3)
    assert all(sorted(rows) == [0, 1, 2, 3] for rows in epochs)
    labels = [b.epoch for b in itertools.islice(PromptBatches(_dataset(4), prompts_per_step=4), 3)]
    assert labels == [0, 1, 2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="prompts_per_step must be >= 1"):
        PromptBatches(_dataset(4), prompts_per_step=0)
    with pytest.raises(ValueError, match="fewer than prompts_per_step=5"):
        PromptBatches(_dataset(4), prompts_per_step=5)
    with pytest.raises(ValueError, match="empty"):
        PromptBatches(_dataset(0), prompts_per_step=1, drop_last=False)
    short = PromptBatches(_dataset(4), prompts_per_step=5, drop_last=False, shuffle=False)
    assert _indices(short, 2) == [[0, 1, 2, 3], [0, 1, 2, 3]]
