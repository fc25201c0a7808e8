"""Sample completions: which rows are shown, which rewards go with them, HTML escaping."""

import pytest
import torch

from rlblocks.notebook.samples import (
    COMPLETION_CHARS,
    Sample,
    pick_samples,
    row_rewards,
    samples_html,
)


def test_rewards_come_from_the_argument_first_then_extras_then_metrics(batch):
    extras = batch.replace(rewards=torch.tensor([0.0, 1.0, 0.5, 0.25]))
    given = [9.0, 8.0, 7.0, 6.0]
    metric_rows = {"rewards": [4.0, 3.0, 2.0, 1.0]}
    assert row_rewards(extras, metric_rows, given) == given
    assert row_rewards(extras, metric_rows) == [0.0, 1.0, 0.5, 0.25]
    assert row_rewards(batch, metric_rows) == [4.0, 3.0, 2.0, 1.0]
    assert row_rewards(batch, {}) is None


def test_rewards_of_the_wrong_shape_are_skipped(batch):
    # reward/mean is a scalar, a length-3 list does not match b = 4, a (b t) tensor has no
    # single number per row: none of them can label the rows.
    assert row_rewards(batch, {"rewards": 0.5}) is None
    assert row_rewards(batch, {"rewards": [1.0, 2.0, 3.0]}) is None
    assert row_rewards(batch, {}, torch.zeros(4, 2)) is None
    assert row_rewards(batch, {"rewards": "1234"}) is None


def test_one_row_per_group_first_then_the_rest(batch):
    rewards = [0.0, 1.0, 0.5, 0.25]
    # Groups in order of appearance: 7 (rows 0, 1) then 3 (rows 2, 3). First rows of each
    # group: 0, 2; then the others in order: 1, 3.
    picked = pick_samples(batch, {}, rewards, k=3)
    assert picked == [
        Sample("What is 1+1?", "<think>easy</think> 2", 0.0),
        Sample("Is 2 < 3?", "yes & <b>sure</b>", 0.5),
        Sample("What is 1+1?", "3", 1.0),
    ]
    assert len(pick_samples(batch, {}, k=10)) == 4
    assert pick_samples(batch, {}, k=0) == []
    assert pick_samples(batch, {}, k=1)[0].reward is None


def test_table_escapes_model_text(batch):
    table = samples_html(pick_samples(batch, {}, [0.0, 1.0, 0.5, 0.25], k=4), step=12)
    assert "&lt;think&gt;easy&lt;/think&gt; 2" in table
    assert "yes &amp; &lt;b&gt;sure&lt;/b&gt;" in table
    assert "Is 2 &lt; 3?" in table
    assert "<think>" not in table and "<b>" not in table
    assert "samples at step 12" in table
    assert table.count("<tr>") == 5  # header + 4 rows


@pytest.mark.parametrize(("reward", "shown"), [(None, "–"), (0.5, "0.5"), (1 / 3, "0.333")])
def test_reward_cell(reward, shown):
    table = samples_html([Sample("p", "c", reward)])
    assert f">{shown}</td></tr>" in table


def test_long_completions_are_cut():
    table = samples_html([Sample("p", "x" * (COMPLETION_CHARS + 50), 1.0)])
    assert "x" * COMPLETION_CHARS + "…" in table
    assert "x" * (COMPLETION_CHARS + 1) not in table
    assert samples_html([]) == ""
