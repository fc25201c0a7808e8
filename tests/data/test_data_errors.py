"""Tests for rlblocks.data.files: a bad data file fails naming the file, the line (or row) and
what is wrong, on real files written to ``tmp_path``."""

from __future__ import annotations

import json
import re

import pytest
from datasets import Dataset

from rlblocks.data import gsm8k, load_prompts
from rlblocks.data.files import read_file

GOOD = {"prompt": "What is 2 + 3?", "ground_truth": "5"}


def _jsonl(tmp_path, *lines: str, name: str = "train.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _fails(path, message: str, **kwargs):
    """load_prompts(path) raises ValueError with ``path`` then ``message`` (a regex)."""
    with pytest.raises(ValueError, match=re.escape(str(path)) + message):
        load_prompts(path, **kwargs)


# ---------------------------------------------------------------------- the file itself
def test_a_broken_json_line_names_file_line_and_json_error(tmp_path):
    path = _jsonl(tmp_path, json.dumps(GOOD), "", '{"prompt": "b", "ground_truth":', "{}")
    # The blank line 2 counts: the broken one is line 3, and column 32 is just past the colon.
    _fails(path, r", line 3: not valid JSON \(Expecting value at column 32\).*JSON Lines")


def test_a_line_that_is_not_an_object(tmp_path):
    path = _jsonl(tmp_path, json.dumps(GOOD), "[1, 2]")
    _fails(path, r", line 2: expected a JSON object \{column: value, ...\}, got list \[1, 2\]")


def test_a_broken_json_array_names_line_and_column(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('[\n  {"prompt": "a", "ground_truth": "1"},\n  {"prompt": "b",,}\n]')
    _fails(path, r", line 3, column 18: not valid JSON \(Expecting property name.*JSON array")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_non_utf8_bytes_name_line_and_byte_offset(tmp_path, suffix):
    path = tmp_path / f"train{suffix}"
    first = (
        b'{"prompt": "a", "ground_truth": "1"}\n\n' if suffix == ".jsonl" else b"prompt,a\nx,1\n"
    )
    path.write_bytes(first + b"caf\xe9\n")  # "café" in Latin-1
    # The byte 0xe9 is the 4th of line 3, right after the len(first) bytes of lines 1 and 2.
    offset = len(first) + 3
    _fails(
        path, rf", line 3: byte 0xe9 at byte offset {offset} of the file \(column 4\) is not UTF-8"
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_an_empty_file_says_it_is_empty(tmp_path, suffix):
    path = tmp_path / f"train{suffix}"
    path.write_text("" if suffix == ".parquet" else " \n\n")
    _fails(path, r": the file is empty; ")


def test_a_file_without_rows(tmp_path):
    header_only = tmp_path / "train.csv"
    header_only.write_text("prompt,ground_truth\n")
    _fails(header_only, r": the file has no rows; CSV in UTF-8 with a header line")
    empty_array = tmp_path / "train.json"
    empty_array.write_text("[]")
    _fails(empty_array, r": the file has no rows; a JSON array of objects")


def test_a_csv_line_with_the_wrong_number_of_fields(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('prompt,ground_truth\n"What is 2 + 3?",5\nWhat is 1, 2 or 3?,1\n')
    _fails(path, r", line 3: 3 fields, but the header line has 2 \(\['prompt', 'ground_truth'\]\)")


def test_a_file_that_is_not_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_text("prompt,ground_truth\n")
    _fails(path, r": not a readable parquet file \(ArrowInvalid: .*magic bytes")


def test_an_unsupported_suffix_lists_the_accepted_files(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("What is 2 + 3?\n")
    _fails(path, r": unsupported file type '.txt'; accepted files: .jsonl: JSON Lines.*\.parquet")


# ---------------------------------------------------------------------- rows and columns
def test_a_lone_surrogate_names_line_row_and_column(tmp_path):
    # "\ud800" is half of a surrogate pair: json reads it, but no tokenizer can encode it.
    path = _jsonl(tmp_path, json.dumps(GOOD), '{"prompt": "a\\ud800b", "ground_truth": "1"}')
    _fails(path, r", line 2 \(row 1\), column 'prompt': character 1 is a lone surrogate U\+D800")
    messages = [{"role": "user", "content": "\udfff"}]
    with pytest.raises(ValueError, match=r"row 0, column 'prompt': character 0 is a lone surr"):
        load_prompts([{"prompt": messages, "ground_truth": "1"}])


def test_the_tokenizer_is_what_a_lone_surrogate_would_break(tokenizer):
    with pytest.raises(TypeError):  # far from the file: why load_prompts checks at load time
        tokenizer("a\ud800b")


def test_an_empty_prompt_names_line_and_row(tmp_path):
    path = _jsonl(tmp_path, json.dumps(GOOD), json.dumps({"prompt": " ", "ground_truth": "1"}))
    _fails(path, r", line 2 \(row 1\), column 'prompt': text is empty")
    messages = tmp_path / "chat.jsonl"
    messages.write_text(json.dumps({"prompt": [], "ground_truth": "1"}) + "\n")
    _fails(messages, r", line 1 \(row 0\), column 'prompt': the list of chat messages is empty")


def test_a_missing_column_names_the_file_and_how_to_map_columns(tmp_path):
    path = _jsonl(tmp_path, json.dumps({"question": "What is 2 + 3?", "answer": "5"}))
    _fails(
        path,
        re.escape(": column(s) ['prompt', 'ground_truth'] not in the data; available columns: ")
        + r"\['question', 'answer'\]; name yours with prompt=..., ground_truth=...",
    )


def test_a_key_missing_from_one_line(tmp_path):
    path = _jsonl(tmp_path, json.dumps(GOOD), json.dumps({"prompt": "b"}))
    _fails(path, r", line 2 \(row 1\): column 'ground_truth' is missing \(row has \['prompt'\]\)")


def test_a_value_of_the_wrong_type_names_line_row_and_column(tmp_path):
    path = _jsonl(
        tmp_path, json.dumps(GOOD), json.dumps({"prompt": {"text": "b"}, "ground_truth": 1})
    )
    _fails(path, r", line 2 \(row 1\), column 'prompt': expected text, got dict")


def test_csv_and_parquet_rows_are_named_by_line_and_by_row(tmp_path):
    csv_path = tmp_path / "train.csv"
    csv_path.write_text('prompt,ground_truth\n"What is\n2 + 3?",5\n\n"",1\n')
    # The quoted prompt spans lines 2-3 and line 4 is blank: the second row starts on line 5.
    _fails(csv_path, r", line 5 \(row 1\), column 'prompt': value is missing")
    parquet_path = tmp_path / "train.parquet"
    Dataset.from_list([GOOD, {"prompt": "b", "ground_truth": None}]).to_parquet(parquet_path)
    _fails(parquet_path, r", row 1, column 'ground_truth': value is missing")


def test_gsm8k_errors_name_the_file_line_too(tmp_path):
    good = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
    path = _jsonl(tmp_path, json.dumps(good), json.dumps({**good, "answer": "no answer"}))
    with pytest.raises(ValueError, match=re.escape(str(path)) + r", line 2 \(row 1\), column 'a"):
        gsm8k(path)
    path = _jsonl(tmp_path, json.dumps(good), json.dumps({**good, "question": ""}), name="g.jsonl")
    with pytest.raises(ValueError, match=re.escape(str(path)) + r", line 2 \(row 1\), column 'q"):
        gsm8k(path)


# ---------------------------------------------------------------------- what still reads
def test_readable_variants(tmp_path):
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfprompt,ground_truth\nWhat is 2 + 3?,5\n")  # Excel's UTF-8
    assert load_prompts(bom).ground_truths == ["5"]
    lines_in_json = tmp_path / "lines.json"
    lines_in_json.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    assert len(load_prompts(lines_in_json)) == 2
    one_object = tmp_path / "one.json"
    one_object.write_text(json.dumps(GOOD, indent=2))
    rows = read_file(one_object)
    assert rows == [GOOD] and rows.where(0) == f"{one_object}, line 1 (row 0)"
    pair = _jsonl(tmp_path, json.dumps({"prompt": "smile \ud83d\ude00", "ground_truth": "1"}))
    assert load_prompts(pair).prompts == ["smile \U0001f600"]  # a full pair is one character
