"""Tests for rlblocks.data.prompts: sources, templates, chat messages, metadata, malformed rows."""

from __future__ import annotations

import json
import math
import re

import pytest
from datasets import Dataset, DatasetDict

from rlblocks.data import (
    BOXED_INSTRUCTION,
    PromptDataset,
    PromptRow,
    instruction_template,
    load_prompts,
)

ROWS = [
    {"question": "What is 2 + 3?", "answer": 5, "level": "easy"},
    {"question": "Tom has 12 apples and buys 7 more. How many?", "answer": 19, "level": "easy"},
    {"question": "What is 6 * 7?", "answer": 42, "level": "medium"},
]


def _write(tmp_path, suffix: str, rows=ROWS):
    path = tmp_path / f"toy{suffix}"
    if suffix == ".json":  # a JSON array, not JSON lines
        path.write_text(json.dumps(rows))
    elif suffix == ".jsonl":
        Dataset.from_list(rows).to_json(path)  # datasets writes JSON lines by default
    elif suffix == ".csv":
        Dataset.from_list(rows).to_csv(path, index=False)
    else:
        Dataset.from_list(rows).to_parquet(path)
    return path


# ---------------------------------------------------------------------- sources
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json", ".csv"])
def test_each_file_type_loads_the_same_rows(tmp_path, suffix):
    path = _write(tmp_path, suffix)
    ds = load_prompts(path, prompt="question", ground_truth="answer", keep=["level"])
    assert isinstance(ds, PromptDataset) and len(ds) == 3 and ds.num_dropped == 0
    assert ds.prompts == [row["question"] for row in ROWS]
    # The integer answers 5, 19, 42 become the text "5", "19", "42".
    assert ds.ground_truths == ["5", "19", "42"]
    assert ds[1].metadata == {"ground_truth": "19", "data_source": "toy", "level": "easy"}
    assert [row.index for row in ds] == [0, 1, 2]


@pytest.mark.parametrize("make", [list, Dataset.from_list], ids=["dicts", "Dataset"])
def test_in_memory_sources(make):
    ds = load_prompts(make(ROWS), prompt="question", ground_truth="answer")
    assert ds.prompts == [row["question"] for row in ROWS]
    assert ds.metadata[2] == {"ground_truth": "42", "data_source": "prompts"}


def test_unsupported_sources(tmp_path):
    with pytest.raises(ValueError, match=r"unsupported file type.*\.parquet"):
        load_prompts(tmp_path / "toy.txt", prompt="question", ground_truth="answer")
    with pytest.raises(FileNotFoundError, match="toy.parquet"):
        load_prompts(tmp_path / "toy.parquet", prompt="question", ground_truth="answer")
    splits = DatasetDict({"train": Dataset.from_list(ROWS)})
    with pytest.raises(TypeError, match=r"DatasetDict with splits \['train'\]"):
        load_prompts(splits, prompt="question", ground_truth="answer")


def test_data_source_column_and_argument():
    rows = [{**row, "data_source": src} for row, src in zip(ROWS, ["a", "b", "a"], strict=True)]
    ds = load_prompts(rows, prompt="question", ground_truth="answer")
    assert [m["data_source"] for m in ds.metadata] == ["a", "b", "a"]
    ds = load_prompts(rows, prompt="question", ground_truth="answer", data_source="mine")
    assert [m["data_source"] for m in ds.metadata] == ["mine"] * 3


def test_unlabelled_prompts():
    ds = load_prompts(ROWS, prompt="question", ground_truth=None)
    assert ds.ground_truths == [None, None, None]
    assert ds[0].metadata == {"ground_truth": None, "data_source": "prompts"}


# ---------------------------------------------------------------------- templates and chat
def test_template_hand_worked():
    ds = load_prompts(
        ROWS, prompt="question", ground_truth="answer", template="Question: {prompt}\nAnswer:"
    )
    assert ds[0].prompt == "Question: What is 2 + 3?\nAnswer:"
    # {question} names the same column as {prompt}; {level} is another column.
    ds = load_prompts(
        ROWS, prompt="question", ground_truth="answer", template="[{level}] {question}"
    )
    assert ds[2].prompt == "[medium] What is 6 * 7?"


def test_instruction_template_keeps_braces():
    template = instruction_template(BOXED_INSTRUCTION)
    ds = load_prompts(ROWS[:1], prompt="question", ground_truth="answer", template=template)
    assert ds[0].prompt == "What is 2 + 3? " + BOXED_INSTRUCTION
    assert ds[0].prompt.endswith("\\boxed{}.")
    assert instruction_template(None) is None


def test_chat_messages_with_system():
    ds = load_prompts(
        ROWS, prompt="question", ground_truth="answer", system="Be brief.", template="Q: {prompt}"
    )
    assert ds[0].prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: What is 2 + 3?"},
    ]
    ds = load_prompts(ROWS, prompt="question", ground_truth="answer", chat=True)
    assert ds[0].prompt == [{"role": "user", "content": "What is 2 + 3?"}]


def test_column_of_chat_messages():
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    rows = [{"prompt": messages, "ground_truth": "5"}]
    ds = load_prompts(rows)
    assert ds[0].prompt == messages
    ds = load_prompts(rows, system="Be brief.")
    assert ds[0].prompt == [{"role": "system", "content": "Be brief."}, *messages]
    with pytest.raises(ValueError, match=r"row 0, column 'prompt': holds chat messages"):
        load_prompts(rows, template="Q: {prompt}")
    with pytest.raises(ValueError, match=r"row 0, column 'prompt': expected text or chat"):
        load_prompts([{"prompt": [{"role": "user"}], "ground_truth": "5"}])


def test_bad_templates():
    with pytest.raises(ValueError, match=r"use named fields"):
        load_prompts(ROWS, prompt="question", ground_truth="answer", template="Q: {}")
    with pytest.raises(ValueError, match=r"\['topic'\] not in the data; available columns"):
        load_prompts(ROWS, prompt="question", ground_truth="answer", template="{topic}: {prompt}")
    with pytest.raises(ValueError, match=r"template 'Q: \{prompt'"):
        load_prompts(ROWS, prompt="question", ground_truth="answer", template="Q: {prompt")


# ---------------------------------------------------------------------- keep / arguments
def test_keep_copies_values_as_they_are():
    rows = [{"q": "a", "a": "1", "extra": {"k": [1, 2]}, "note": None}]
    ds = load_prompts(rows, prompt="q", ground_truth="a", keep=["extra", "note"])
    assert ds[0].metadata == {
        "ground_truth": "1",
        "data_source": "prompts",
        "extra": {"k": [1, 2]},
        "note": None,
    }
    with pytest.raises(ValueError, match=r"keep=\['ground_truth'\]"):
        load_prompts(rows, prompt="q", ground_truth="a", keep=["ground_truth"])


def test_argument_errors(tokenizer):
    with pytest.raises(ValueError, match="tokenizer= and max_prompt_tokens= together"):
        load_prompts(ROWS, prompt="question", ground_truth="answer", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="overlong must be"):
        load_prompts(ROWS, prompt="question", ground_truth="answer", overlong="drop")


# ---------------------------------------------------------------------- malformed rows
def test_missing_column_lists_the_available_ones():
    message = re.escape("column(s) ['solution'] not in the data; available columns: ")
    with pytest.raises(ValueError, match=message + r"\['question', 'answer', 'level'\]"):
        load_prompts(ROWS, prompt="question", ground_truth="solution")
    with pytest.raises(ValueError, match=r"ground_truth=None loads unlabelled prompts"):
        load_prompts(ROWS, prompt="question")  # ground_truth defaults to "ground_truth"


def test_missing_key_in_one_row():
    rows = [ROWS[0], {"question": "What is 1 + 1?"}, ROWS[2]]
    with pytest.raises(ValueError, match=r"row 1: column 'answer' is missing"):
        load_prompts(rows, prompt="question", ground_truth="answer")


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (None, "value is missing"),
        (math.nan, "value is missing"),
        ("", "text is empty"),
        ("   ", "text is empty"),
        ({"text": "x"}, "expected text, got dict"),
        (["x"], "expected text, got list"),
        (True, "expected text, got bool"),
    ],
)
@pytest.mark.parametrize("column", ["question", "answer"])
def test_malformed_value_names_row_and_column(bad, expected, column):
    rows = [dict(row) for row in ROWS]
    rows[2][column] = bad
    if column == "question" and isinstance(bad, list):
        expected = "expected text or chat messages"  # a list in the prompt column is messages
    with pytest.raises(ValueError, match=rf"row 2, column '{column}': {expected}"):
        load_prompts(rows, prompt="question", ground_truth="answer")


def test_malformed_row_in_a_parquet_file(tmp_path):
    rows = [dict(row) for row in ROWS]
    rows[1]["question"] = None
    path = _write(tmp_path, ".parquet", rows)
    with pytest.raises(ValueError, match=r"row 1, column 'question': value is missing"):
        load_prompts(path, prompt="question", ground_truth="answer")


def test_numbers_become_text():
    rows = [{"q": 7, "a": 72}, {"q": "x", "a": 72.0}, {"q": "y", "a": 2.5}, {"q": "z", "a": -3}]
    ds = load_prompts(rows, prompt="q", ground_truth="a")
    # 72.0 is an integer read as a float (a CSV column with gaps): written as "72".
    assert ds.ground_truths == ["72", "72", "2.5", "-3"]
    assert ds.prompts[0] == "7"


def test_non_mapping_row():
    with pytest.raises(TypeError, match="row 1: expected a mapping"):
        load_prompts([ROWS[0], "not a row"], prompt="question", ground_truth="answer")


# ---------------------------------------------------------------------- PromptDataset
def test_prompt_dataset_sequence_behaviour():
    rows = [PromptRow(prompt=f"p{i}", ground_truth=str(i), metadata={}, index=i) for i in range(4)]
    ds = PromptDataset(rows, dropped=[7])
    assert len(ds) == 4 and ds[-1] is rows[-1] and list(ds) == rows
    part = ds[1:3]
    assert isinstance(part, PromptDataset) and part.prompts == ["p1", "p2"]
    assert part.num_dropped == 1 and "4 rows, 1 dropped" in repr(ds)


# ---------------------------------------------------------------------- keep=True (TRL / verl)
def test_keep_true_carries_every_column_of_a_conversational_dataset(tmp_path):
    messages = [
        {"role": "system", "content": "Be brief.", "name": "judge"},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    row = {
        "data_source": "openai/gsm8k",
        "prompt": messages,
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"split": "train", "index": 0},
        "solution": "2 + 2 = 4",
    }
    source = Dataset.from_list([row])
    # Arrow gives every message every key: the user turn gets "name": None.
    assert source[0]["prompt"][1] == {"role": "user", "content": "What is 2 + 2?", "name": None}
    path = tmp_path / "verl.parquet"
    source.to_parquet(path)
    for given, held in ((source, source[0]), (path, source[0]), ([row], row)):
        ds = load_prompts(given, ground_truth="reward_model.ground_truth", keep=True)
        assert ds[0].prompt == messages  # keys that hold None dropped, "name" kept
        assert ds[0].ground_truth == "4"
        # Every column as the source holds it (the prompt too), and rb.data's two keys.
        assert ds[0].metadata == {**held, "ground_truth": "4", "data_source": "openai/gsm8k"}


def test_keep_true_text_prompts():
    ds = load_prompts(
        ROWS, prompt="question", ground_truth="answer", keep=True, template="Q: {prompt}"
    )
    # The prompt column keeps the dataset's text; the engine's prompt is the formatted one.
    assert ds[0].prompt == "Q: What is 2 + 3?"
    assert ds[0].metadata == {
        "ground_truth": "5", "data_source": "prompts", **ROWS[0],
    }  # fmt: skip


def test_nested_ground_truth_errors_name_row_and_column():
    rows = [
        {"prompt": "a", "reward_model": {"ground_truth": "1"}},
        {"prompt": "b", "reward_model": {}},
    ]
    with pytest.raises(ValueError, match=r"row 1, column 'reward_model': no field 'ground_truth'"):
        load_prompts(rows, ground_truth="reward_model.ground_truth")
    with pytest.raises(ValueError, match=r"column\(s\) \['answer'\] not in the data"):
        load_prompts(rows, ground_truth="answer.value")
