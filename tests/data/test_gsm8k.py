"""Tests for rlblocks.data.gsm8k: the ``#### <number>`` answer layout, read from parquet."""

from __future__ import annotations

import pytest
from datasets import Dataset

from rlblocks.data import HASH_INSTRUCTION, gsm8k, gsm8k_final_answer

ROWS = [
    {
        "question": "Natalia sold clips to 48 friends in April, and half as many in May. "
        "How many clips did she sell altogether?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n"
        "Altogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72",
    },
    {
        "question": "A shop sells 1,000 pens a day for 3 days. How many pens?",
        "answer": "1,000 * 3 = <<1000*3=3000>>3,000\n#### 3,000",
    },
    {
        "question": "It was 5 degrees and dropped by 8 degrees. What is the temperature?",
        "answer": "5 - 8 = -3\n#### -3",
    },
]


@pytest.fixture
def parquet(tmp_path):
    path = tmp_path / "train-00000-of-00001.parquet"
    Dataset.from_list(ROWS).to_parquet(path)
    return path


def test_final_answer_hand_worked():
    assert gsm8k_final_answer(ROWS[0]["answer"]) == "72"
    assert gsm8k_final_answer("#### 3,000") == "3000"  # thousands separator removed
    assert gsm8k_final_answer("#### -3\n") == "-3"
    assert gsm8k_final_answer("a #### 1\n#### 2") == "2"  # the last marker counts
    assert gsm8k_final_answer("no marker, 72") is None
    assert gsm8k_final_answer("72\n####  ") is None


def test_gsm8k_from_parquet(parquet):
    ds = gsm8k(parquet)
    assert ds.ground_truths == ["72", "3000", "-3"]
    assert ds.prompts == [f"{row['question']} {HASH_INSTRUCTION}" for row in ROWS]
    assert ds[0].metadata == {
        "ground_truth": "72",
        "data_source": "gsm8k",
        "solution": ROWS[0]["answer"],
    }


def test_gsm8k_options(parquet):
    bare = gsm8k(parquet, instruction=None)
    assert bare.prompts == [row["question"] for row in ROWS]
    chat = gsm8k(parquet, instruction=None, system="Solve it.")
    assert chat[2].prompt == [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": ROWS[2]["question"]},
    ]
    rows = [{**row, "id": k} for k, row in enumerate(ROWS)]
    kept = gsm8k(rows, keep=["id"])
    assert [m["id"] for m in kept.metadata] == [0, 1, 2]
    assert kept[1].metadata["solution"] == ROWS[1]["answer"]


def test_gsm8k_malformed_answer_names_the_row(tmp_path):
    rows = [ROWS[0], {"question": "q?", "answer": "no final answer"}]
    with pytest.raises(ValueError, match=r"row 1, column 'answer': expected a solution ending"):
        gsm8k(rows)
    with pytest.raises(ValueError, match=r"row 0, column 'answer'"):
        gsm8k([{"question": "q?", "answer": None}])
    with pytest.raises(ValueError, match=r"\['answer'\] not in the data; available columns"):
        gsm8k([{"question": "q?", "solution": "#### 1"}])


def test_keep_true_keeps_every_column():
    rows = [{"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4", "id": 7}]
    ds = gsm8k(rows, instruction=None, keep=True)
    assert ds[0].metadata == {
        "ground_truth": "4",
        "data_source": "gsm8k",
        "question": "2 + 2?",
        "answer": "2 + 2 = 4\n#### 4",
        "id": 7,
        "solution": "2 + 2 = 4\n#### 4",
    }
