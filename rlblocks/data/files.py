"""Reading prompt data files: every error names the file, the line (or row) and what is wrong.

    rows = read_file("train.jsonl")      # Rows: a list of dicts that knows where each came from
    rows.where(2)                        # "train.jsonl, line 4 (row 2)"

Choices made here:

- **JSON Lines and JSON** are read with Python's ``json``, not ``datasets`` / pyarrow: a broken
  line is reported as ``file, line N: not valid JSON (…)``, values keep their JSON types, and a
  ``"\\ud800"`` escape (half a surrogate pair) reaches `load_prompts`, which rejects it by row
  and column instead of pyarrow failing on the whole file.
- **CSV** is checked line by line with Python's ``csv`` (UTF-8, quoting, the number of fields
  against the header) and then read with ``datasets`` (pandas), which keeps its type inference:
  ``72`` is a number, an empty cell a missing value.
- **Parquet** is read with ``datasets``; a file that is not parquet says so with pyarrow's reason.
- Bytes that are not UTF-8 are reported by line, byte offset and column; a UTF-8 byte-order mark
  is accepted. An empty file, or one without a single row, is an error.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
from datasets import Dataset
from datasets.exceptions import DatasetGenerationError

__all__ = ["FORMATS", "Rows", "read_file"]

FORMATS = {
    ".jsonl": 'JSON Lines, one object per line: {"prompt": "What is 2 + 3?", "ground_truth": "5"}',
    ".json": 'a JSON array of objects, [{"prompt": ..., "ground_truth": ...}, ...], or JSON Lines',
    ".csv": "CSV in UTF-8 with a header line naming the columns",
    ".parquet": "a parquet table with one row per prompt",
}
"""The file types `read_file` reads (by suffix), and what each must hold."""


def accepted() -> str:
    """The accepted file types as one sentence, for error messages."""
    return "accepted files: " + "; ".join(f"{suffix}: {text}" for suffix, text in FORMATS.items())


class Rows(list[Mapping[str, Any]]):
    """Rows (mappings of column -> value) with their origin: ``file`` and each row's ``lines``.

    ``file`` is None for rows given in memory; ``lines`` (the 1-based line where each row
    starts) is None where a row has no line (parquet, a JSON array, memory). ``columns``: every
    column of the source, also those a reader left out; by default the keys of all rows.
    """

    def __init__(
        self,
        rows: Iterable[Mapping[str, Any]] = (),
        *,
        file: Path | None = None,
        lines: list[int] | None = None,
        columns: Iterable[str] | None = None,
    ) -> None:
        super().__init__(rows)
        self.file = file
        self.columns = list(columns) if columns is not None else _keys(self)
        self.lines = lines if lines is not None and len(lines) == len(self) else None

    def where(self, index: int) -> str:
        """Row ``index`` in words: ``"f.jsonl, line 4 (row 2)"``, ``"f.parquet, row 2"``."""
        if self.file is None:
            return f"row {index}"
        if self.lines is None:
            return f"{self.file}, row {index}"
        return f"{self.file}, line {self.lines[index]} (row {index})"

    def origin(self) -> str:
        """``"f.jsonl: "`` for rows read from a file, else ``""`` (a prefix for messages)."""
        return "" if self.file is None else f"{self.file}: "

    def like(self, rows: Iterable[Mapping[str, Any]]) -> Rows:
        """Other rows, one per row of these, with the same origin (rows rewritten in place)."""
        return Rows(rows, file=self.file, lines=self.lines)


def _keys(rows: Rows) -> list[str]:
    keys: dict[str, None] = {}
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(
                f"rb.data: {rows.where(index)}: expected a mapping of column -> value, got "
                f"{row!r:.80}; give every row as a dict"
            )
        keys.update(dict.fromkeys(row))
    return list(keys)


def read_file(path: str | os.PathLike[str], *, columns: Iterable[str] | None = None) -> Rows:
    """The rows of a ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file (see `FORMATS`).

    ``columns``: read only these (those the file has) from a CSV or parquet file; JSON rows
    keep every key. ``Rows.columns`` lists all the file's columns either way.

    Raises ``FileNotFoundError``, or ``ValueError`` naming the file, the line or row, what is
    wrong and the accepted formats: an unknown suffix, an empty file, bytes that are not UTF-8,
    a line that is not JSON or not an object, a CSV line with the wrong number of fields, a
    file that is not parquet, a file without rows.
    """
    path = Path(path)
    if path.suffix not in FORMATS:
        raise ValueError(f"read_file: {path}: unsupported file type {path.suffix!r}; {accepted()}")
    if not path.is_file():
        raise FileNotFoundError(f"read_file: {path}: no such file; check the path")
    wanted = None if columns is None else list(dict.fromkeys(columns))
    if path.suffix == ".parquet":
        rows = _parquet(path, wanted)
    else:
        text = _utf8(path, path.read_bytes())
        if not text.strip():
            raise ValueError(f"read_file: {path}: the file is empty; {FORMATS[path.suffix]}")
        if path.suffix == ".csv":
            rows = _csv(path, text, wanted)
        else:
            rows = (_jsonl if path.suffix == ".jsonl" else _json)(path, text)
    if not rows:
        raise ValueError(f"read_file: {path}: the file has no rows; {FORMATS[path.suffix]}")
    return rows


def _utf8(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")  # a byte-order mark is dropped
    except UnicodeDecodeError as error:
        offset = error.start
        line = data.count(b"\n", 0, offset) + 1
        column = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
        raise ValueError(
            f"read_file: {path}, line {line}: byte 0x{data[offset]:02x} at byte offset {offset} "
            f"of the file (column "
            f"{column}) is not UTF-8 ({error.reason}); save the file as UTF-8, e.g. "
            f"`iconv -f latin1 -t utf-8`"
        ) from None


def _jsonl(path: Path, text: str) -> Rows:
    rows, lines = [], []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may be in a string
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"read_file: {path}, line {number}: not valid JSON ({error.msg} at column "
                f"{error.colno}): "
                f"{line.strip()!r:.100}; expected {FORMATS['.jsonl']}"
            ) from None
        rows.append(_object(value, f"{path}, line {number}"))
        lines.append(number)
    return Rows(rows, file=path, lines=lines)


def _json(path: Path, text: str) -> Rows:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # more than one value: JSON Lines
            return _jsonl(path, text)
        raise ValueError(
            f"read_file: {path}, line {error.lineno}, column {error.colno}: not valid JSON "
            f"({error.msg}); "
            f"expected {FORMATS['.json']}"
        ) from None
    if isinstance(value, dict):  # one object, maybe over several lines: one row
        first = text[: len(text) - len(text.lstrip())].count("\n") + 1
        return Rows([value], file=path, lines=[first])
    if not isinstance(value, list):
        raise ValueError(  # noqa: TRY004 -- bad data in a file is always a ValueError
            f"read_file: {path}: holds a JSON {type(value).__name__}; expected {FORMATS['.json']}"
        )
    rows = [_object(item, f"{path}, row {index}") for index, item in enumerate(value)]
    return Rows(rows, file=path)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(  # noqa: TRY004 -- bad data in a file is always a ValueError
            f"read_file: {where}: expected a JSON object {{column: value, ...}}, got "
            f"{type(value).__name__} {value!r:.80}; write every row as one JSON object"
        )
    return value


def _csv(path: Path, text: str, columns: list[str] | None) -> Rows:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    lines: list[int] = []
    try:
        header = next(reader)
        start = reader.line_num + 1
        for record in reader:
            if record and len(record) != len(header):
                raise ValueError(
                    f"read_file: {path}, line {start}: {len(record)} fields, but the header line has "
                    f"{len(header)} ({header}); {FORMATS['.csv']}"
                )
            if record:
                lines.append(start)
            start = reader.line_num + 1
    except csv.Error as error:
        raise ValueError(
            f"read_file: {path}, line {reader.line_num}: not valid CSV ({error}); {FORMATS['.csv']}"
        ) from None
    if not lines:
        return Rows(file=path, columns=header)
    return _read_with_datasets(path, Dataset.from_csv, columns, lines)


def _parquet(path: Path, columns: list[str] | None) -> Rows:
    if path.stat().st_size == 0:
        raise ValueError(f"read_file: {path}: the file is empty; {FORMATS['.parquet']}")
    return _read_with_datasets(path, Dataset.from_parquet, columns, None)


def _read_with_datasets(
    path: Path, reader: Any, columns: list[str] | None, lines: list[int] | None
) -> Rows:
    try:
        table = reader(str(path), keep_in_memory=True)
    except (pa.ArrowException, DatasetGenerationError, OSError, ValueError) as error:
        cause = error.__cause__ or error
        kind = path.suffix.lstrip(".")
        raise ValueError(
            f"read_file: {path}: not a readable {kind} file ({type(cause).__name__}: {cause}); "
            f"{FORMATS[path.suffix]}"
        ) from error
    available = list(table.column_names)
    if columns is not None:
        table = table.select_columns([name for name in columns if name in available])
    return Rows(table.to_list(), file=path, lines=lines, columns=available)
