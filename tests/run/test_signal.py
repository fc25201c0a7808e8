"""Steps without a learning signal (rlblocks/run/signal.py): the two metrics, hand-worked, and
the warnings a real run gives after `PATIENCE` such steps, and only then."""

from __future__ import annotations

import warnings

import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import count_prompts

import rlblocks as rb
from rlblocks.run.loop import Run
from rlblocks.run.signal import PATIENCE, SignalWatch, informative_share


def rows(rewards: list[float], groups: list[int], lengths: list[int] | None = None):
    lengths = lengths or [2] * len(rewards)
    rollouts = rb.Rollouts.from_lists([[1, 2]] * len(rewards), [[5] * n for n in lengths])
    return rollouts.replace(rewards=torch.tensor(rewards), group_ids=torch.tensor(groups))


def test_informative_share_hand_worked():
    # Groups 0 {1, 0}: mixed; 1 {1, 1}, 2 {0, 0}: flat; 3 {0.5}: one sample, flat. 1 of 4.
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert informative_share(rewards, groups) == 0.25
    # Group ids need not be contiguous or sorted: {7: 2, 3}, {2: 2, 2}, {9: 0, 1}: 2 of 3.
    groups = torch.tensor([7, 2, 7, 2, 9, 9])
    assert informative_share(torch.tensor([2.0, 2.0, 3.0, 2.0, 0.0, 1.0]), groups) == 2 / 3


def test_cut_off_share_counts_rows_at_the_budget():
    watch = SignalWatch("T")
    metrics = watch.observe(0, rows([0.0, 1.0, 0.0, 1.0], [0, 0, 1, 1], [4, 3, 4, 1]), budget=4)
    assert metrics == {"signal/informative_groups": 1.0, "signal/cut_off": 0.5}
    assert watch.observe(1, rows([0.0], [0]), budget=None) == {"signal/informative_groups": 0.0}


def flat_run(rewards_per_step: list[list[float]]) -> tuple[Run, list[warnings.WarningMessage]]:
    """A real `Run` recording one step per entry, groups of two rows."""
    run = Run("flat", steps=len(rewards_per_step), progress=False)
    steps = iter(rewards_per_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with run.driving():
            for _ in run:
                rewards = next(steps)
                run.record({}, rows(rewards, [i // 2 for i in range(len(rewards))]))
    return run, [w for w in caught if "learning signal" in str(w.message)]


def test_a_run_whose_groups_all_tie_warns_once_after_patience_steps():
    run, caught = flat_run([[0.0] * 4] * (PATIENCE + 2))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"Run 'flat': steps 0-{PATIENCE - 1} had no learning signal")
    assert "every reward was 0" in message and "signal/informative_groups" in message
    assert [m["signal/informative_groups"] for m in run.history] == [0.0] * (PATIENCE + 2)


def test_fewer_flat_steps_in_a_row_than_patience_do_not_warn():
    mixed = [1.0, 0.0, 1.0, 1.0]
    # flat steps separated by a step with a mixed group: never PATIENCE in a row
    pattern = ([[1.0] * 4] * (PATIENCE - 1) + [mixed]) * 2
    run, caught = flat_run(pattern)
    assert caught == []
    assert run.history[PATIENCE - 1]["signal/informative_groups"] == 0.5
    # ties within groups but different values across groups are still flat
    _, caught = flat_run([[1.0, 1.0, 0.0, 0.0]] * PATIENCE)
    assert len(caught) == 1 and "took 2 values, but never two within one group" in str(
        caught[0].message
    )


def test_a_source_whose_answers_never_end_warns_naming_the_budget():
    # min_new_tokens = max_new_tokens forbids the end token: every row runs to the budget.
    policy = tiny_trainer()
    engine = tiny_engine(policy)
    sampling = rb.SamplingParams(max_new_tokens=4, min_new_tokens=4, seed=0)
    batches = rb.data.PromptBatches(count_prompts(), prompts_per_step=2, seed=0)
    source = rb.run.RolloutSource(engine, policy, batches, group_size=2, sampling=sampling)
    run = Run("budget", steps=PATIENCE, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with run.driving(source):
            for _ in run:
                run.record({}, source.draw())
    assert [m["signal/cut_off"] for m in run.history] == [1.0] * PATIENCE
    said = [w for w in caught if "ran to the token budget" in str(w.message)]
    assert len(said) == 1
    assert str(said[0].message).startswith(f"Run 'budget': in steps 0-{PATIENCE - 1} every")
    assert "max_new_tokens" in str(said[0].message)


def test_rows_that_end_within_the_budget_do_not_warn():
    watch = SignalWatch("T")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        for step in range(PATIENCE * 2):  # one row of each step ends before the budget of 4
            watch.observe(step, rows([0.0, 1.0], [0, 0], [4, 3]), budget=4)
