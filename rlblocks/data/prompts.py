"""Prompt datasets: rows of (prompt, ground truth, metadata) read from a file or from memory.

    ds = rb.data.load_prompts("train.parquet", prompt="question", ground_truth="answer",
                              template="Question: {prompt}\\nAnswer:")
    ds[0].prompt, ds[0].ground_truth, ds[0].metadata  # str, "72", {"ground_truth": "72", ...}

A prompt is raw text or chat messages (``rlblocks.interfaces.Prompt``); a rollout engine takes
``ds.prompts`` as they are. ``metadata`` is what reward functions read (``ground_truth``,
``data_source`` and the columns named in ``keep``; ``keep=True`` keeps every column, the
prompt column included, as the source holds it: what TRL's and verl's reward functions read).

Choices made here:

- **Sources**: a ``.parquet`` / ``.jsonl`` / ``.json`` / ``.csv`` file (`rlblocks.data.files`),
  a ``datasets.Dataset``, or a list of dicts. The whole dataset becomes Python objects at load
  time, so every malformed row is reported before training starts (fine up to ~10⁶ rows), by
  file, line (or row) and column.
- **Text**: strings, and numbers written as text (``72`` and ``72.0`` -> ``"72"``, since CSV
  readers turn integer columns with a gap into floats). None, NaN, empty strings, booleans,
  dicts and lists are errors naming the row and the column, and so is a lone surrogate
  (``"\\ud800"`` in JSON: not Unicode, so a tokenizer would fail on it later).
- **Templates**: ``str.format`` with column names; ``{prompt}`` is always the prompt column,
  so one template fits datasets whose question column is named differently.
- **Chat**: ``chat=True`` or a ``system`` string gives ``[system?, user]`` messages. A prompt
  column that already holds messages (TRL's conversational and verl's parquet layouts) is
  taken as it is, each message with all its keys (``name``, ...) except those that hold None
  (a ``datasets.Dataset`` gives every message the keys of all of them, None where absent).
- **Nested ground truth**: ``ground_truth="reward_model.ground_truth"`` reads a field of a
  dict column (verl's layout).
- **Length**: with ``tokenizer`` and ``max_prompt_tokens``, `limit_prompt_length` applies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from datasets import Dataset, DatasetDict

from rlblocks.data.dataset import PromptDataset, PromptRow
from rlblocks.data.files import Rows, read_file
from rlblocks.data.length import Overlong, limit_prompt_length
from rlblocks.data.names import DATA

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "BOXED_INSTRUCTION",
    "HASH_INSTRUCTION",
    "PromptDataset",
    "PromptRow",
    "instruction_template",
    "load_prompts",
    "read_rows",
]

HASH_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""Instruction suffix for answers read by ``rlblocks.rewards.math_answer`` after ``####``."""
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""Instruction suffix for answers read from ``\\boxed{…}`` (plain text: no format braces)."""

_RESERVED = ("ground_truth", "data_source")

Source: TypeAlias = str | os.PathLike[str] | Dataset | Sequence[Mapping[str, Any]]


@DATA.register("file")  # source: a .jsonl / .json / .csv / .parquet file
def load_prompts(
    source: Source,
    *,
    prompt: str = "prompt",
    ground_truth: str | None = "ground_truth",
    template: str | None = None,
    system: str | None = None,
    chat: bool = False,
    keep: Sequence[str] | bool = (),
    data_source: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_prompt_tokens: int | None = None,
    overlong: Overlong = "error",
) -> PromptDataset:
    """Read prompts from a file, a ``datasets.Dataset`` or a list of dicts.

    Args:
        source: ``.parquet`` / ``.jsonl`` / ``.json`` / ``.csv`` path, a Dataset, or dicts.
        prompt: the column holding the question text (or chat messages).
        ground_truth: the column holding the reference answer; None for unlabelled prompts;
            ``"column.field"`` reads a field of a dict column (``"reward_model.ground_truth"``).
        template: ``str.format`` template over column names, ``{prompt}`` meaning the prompt
            column, e.g. ``"Question: {prompt}\\nAnswer:"``. None uses the question as it is.
        system: a system message; implies ``chat=True``.
        chat: make ``[system?, user]`` chat messages instead of raw text.
        keep: further columns copied into ``metadata``, values as they are; ``True``: every
            column of the source (the prompt column too, under its own name, as the source
            holds it) but ``ground_truth`` and ``data_source``, which are always there.
        data_source: ``metadata["data_source"]``; default: a ``data_source`` column if the
            data has one, else the file name without its suffix, else ``"prompts"``.
        tokenizer, max_prompt_tokens, overlong: see `limit_prompt_length` ("error",
            "truncate" or "filter"); both tokenizer and max_prompt_tokens or neither.

    Returns a `PromptDataset`. Raises ``ValueError`` naming the columns available when a column
    is missing from the data, and naming the file, line (or row index) and column for a
    malformed value; `rlblocks.data.files.read_file` for the errors of the file itself.
    """
    if (tokenizer is None) != (max_prompt_tokens is None):
        raise ValueError(
            f"load_prompts: tokenizer={'None' if tokenizer is None else 'given'} but "
            f"max_prompt_tokens={max_prompt_tokens}; pass tokenizer= and max_prompt_tokens= "
            "together (or neither)"
        )
    if overlong not in ("error", "truncate", "filter"):
        raise ValueError(
            f"load_prompts: overlong must be 'error', 'truncate' or 'filter', got {overlong!r}; "
            "pass one of them"
        )
    keep_all = keep is True
    keep = () if isinstance(keep, bool) else tuple(keep)
    if reserved := [name for name in keep if name in _RESERVED]:
        raise ValueError(
            f"load_prompts: keep={reserved}, but {_RESERVED} are always in the metadata; leave "
            "them out of keep"
        )
    spec = _RowSpec(prompt, ground_truth, template, system, chat or system is not None, keep)
    optional = ["data_source"] if data_source is None else []
    rows, columns = read_rows(
        source, columns=spec.columns(), optional=optional, all_columns=keep_all
    )
    if keep_all:
        spec = dataclasses.replace(spec, keep=[c for c in columns if c not in _RESERVED])
    if data_source is None and "data_source" not in columns:
        data_source = "prompts" if rows.file is None else rows.file.stem
    dataset = PromptDataset(
        spec.build(i, rows.where(i), row, data_source) for i, row in enumerate(rows)
    )
    if max_prompt_tokens is None:
        return dataset
    assert tokenizer is not None  # given with max_prompt_tokens (checked above)
    return limit_prompt_length(
        dataset, tokenizer, max_prompt_tokens=max_prompt_tokens, overlong=overlong
    )


def read_rows(
    source: Source,
    *,
    columns: Sequence[str],
    optional: Sequence[str] = (),
    all_columns: bool = False,
) -> tuple[Rows, list[str]]:
    """Rows of ``source`` as mappings (`Rows`: they know their file and lines), and the names
    of all its columns.

    ``columns`` must all exist (else ``ValueError`` listing the columns there are); a parquet
    or CSV file or a Dataset is cut down to them and to the ``optional`` columns it has, unless
    ``all_columns``. JSON rows and a list of dicts are returned as they are: a key missing from
    some rows is reported per row by `load_prompts`.
    """
    rows = _open(source, None if all_columns else [*columns, *optional])
    columns = [name.split(".", 1)[0] for name in columns]  # "reward_model.ground_truth"
    if missing := [name for name in dict.fromkeys(columns) if name not in rows.columns]:
        hint = "; ground_truth=None loads unlabelled prompts" if "ground_truth" in missing else ""
        raise ValueError(
            f"read_rows: {rows.origin()}column(s) {missing} not in the data; available "
            f"columns: {rows.columns}; name yours with prompt=..., ground_truth=...{hint}"
        )
    return rows, rows.columns


def instruction_template(instruction: str | None) -> str | None:
    """A `load_prompts` template: the question, a space, then ``instruction`` as plain text.

    ``instruction_template(BOXED_INSTRUCTION)`` -> ``"{prompt} Please … within \\boxed{{}}."``
    (braces escaped so that ``str.format`` leaves them). None gives None (the bare question).
    """
    if instruction is None:
        return None
    return "{prompt} " + instruction.replace("{", "{{").replace("}", "}}")


# ---------------------------------------------------------------------- reading
def _open(source: Source, columns: Sequence[str] | None) -> Rows:
    """The rows of ``source``; ``columns``: read only these where the format allows (None:
    all); a dotted name ``"a.b"`` stands for its column ``a``."""
    if columns is not None:
        columns = [name.split(".", 1)[0] for name in columns]
    if isinstance(source, DatasetDict):
        raise TypeError(f"read_rows: got a DatasetDict with splits {list(source)}; pass one split")
    if isinstance(source, Dataset):
        available = list(source.column_names)
        if columns is not None:
            source = source.select_columns([n for n in dict.fromkeys(columns) if n in available])
        return Rows(source.to_list(), columns=available)
    if isinstance(source, str | os.PathLike):
        return read_file(source, columns=columns)
    if isinstance(source, Rows):
        return source
    if isinstance(source, Sequence):
        return Rows(source)  # type: ignore[arg-type]  # datasets is untyped: Source holds an Any
    raise TypeError(
        f"read_rows: source is {type(source).__name__} {source!r:.80}; pass a path, a "
        "datasets.Dataset or a list of dicts"
    )


# ---------------------------------------------------------------------- one row
@dataclass(frozen=True)
class _RowSpec:
    """How to turn one source row into a `PromptRow` (the column mapping and the template)."""

    prompt: str
    ground_truth: str | None
    template: str | None
    system: str | None
    chat: bool
    keep: Sequence[str]

    @functools.cached_property
    def fields(self) -> list[str]:
        """Columns named in the template, other than ``{prompt}`` (the prompt column)."""
        if self.template is None:
            return []
        try:
            parsed = list(string.Formatter().parse(self.template))
        except ValueError as error:
            raise ValueError(
                f"load_prompts: template {self.template!r}: {error}; write it as str.format "
                "text such as 'Q: {prompt}'"
            ) from None
        names = []
        for _, field, _, _ in parsed:
            if field is not None and (not field or field.isdigit()):
                raise ValueError(
                    f"load_prompts: template {self.template!r} has the field {{{field}}}; use "
                    "named fields such as {prompt}"
                )
            if field is not None:
                names.append(re.split(r"[.\[]", field)[0])
        return [name for name in dict.fromkeys(names) if name != "prompt"]

    def columns(self) -> list[str]:
        gt = [self.ground_truth] if self.ground_truth is not None else []
        return [self.prompt, *self.fields, *gt, *self.keep]

    def build(
        self, index: int, where: str, row: Mapping[str, Any], data_source: str | None
    ) -> PromptRow:
        """Row ``index`` of the source; ``where`` names it in errors (`Rows.where`)."""
        question = _value(row, where, self.prompt)
        if isinstance(question, list):
            prompt: str | list[dict[str, str]] = self._given_messages(question, where)
        else:
            text = _text(question, where, self.prompt)
            if self.template is not None:
                values = {
                    name: _text(_value(row, where, name), where, name) for name in self.fields
                }
                text = self.template.format_map({**values, "prompt": text})
            prompt = self._wrap(text)
        truth = None
        if self.ground_truth is not None:
            truth = _text(_field(row, where, self.ground_truth), where, self.ground_truth)
        source = data_source or _text(_value(row, where, "data_source"), where, "data_source")
        metadata = {"ground_truth": truth, "data_source": source}
        metadata.update({name: _value(row, where, name, required=False) for name in self.keep})
        return PromptRow(prompt=prompt, ground_truth=truth, metadata=metadata, index=index)

    def _wrap(self, text: str) -> str | list[dict[str, str]]:
        if not self.chat:
            return text
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, {"role": "user", "content": text}]

    def _given_messages(self, messages: list[Any], where: str) -> list[dict[str, str]]:
        if self.template is not None:
            raise ValueError(
                f"load_prompts: {where}, column {self.prompt!r}: holds chat messages, and "
                "template= only formats text columns; drop template= for this column"
            )
        if not messages:
            raise ValueError(
                f"load_prompts: {where}, column {self.prompt!r}: the list of chat messages is "
                "empty; give every row at least one message"
            )
        for message in messages:
            if not (
                isinstance(message, Mapping)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ValueError(  # noqa: TRY004 -- bad data in a row is always a ValueError
                    f"load_prompts: {where}, column {self.prompt!r}: expected text or chat "
                    f"messages with str 'role' and 'content', got {message!r:.80}; fix that row"
                )
            _unicode(message["role"], where, self.prompt)
            _unicode(message["content"], where, self.prompt)
        out = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if self.system is not None and (not out or out[0]["role"] != "system"):
            out.insert(0, {"role": "system", "content": self.system})
        return out


def _value(row: Mapping[str, Any], where: str, column: str, *, required: bool = True) -> Any:
    if column not in row:
        raise ValueError(
            f"rb.data: {where}: column {column!r} is missing (row has {list(row)}); give every "
            "row that column"
        )
    value = row[column]
    if required and (value is None or (isinstance(value, float) and math.isnan(value))):
        raise ValueError(
            f"rb.data: {where}, column {column!r}: value is missing (None); fill it in, or "
            "drop the row"
        )
    return value


def _field(row: Mapping[str, Any], where: str, path: str) -> Any:
    """``row["a"]["b"]`` for ``path="a.b"`` (a plain column name reads the column)."""
    column, *fields = path.split(".")
    value = _value(row, where, column)
    for depth, name in enumerate(fields, 1):
        if not isinstance(value, Mapping) or name not in value:
            inner = ".".join([column, *fields[: depth - 1]])
            got = list(value) if isinstance(value, Mapping) else type(value).__name__
            raise ValueError(
                f"load_prompts: {where}, column {inner!r}: no field {name!r} (has {got}); give "
                "every row that field"
            )
        value = value[name]
        if value is None:
            raise ValueError(
                f"load_prompts: {where}, column {path!r}: value is missing (None); fill it in, "
                "or drop the row"
            )
    return value


def _text(value: Any, where: str, column: str) -> str:
    """A value as text: str as it is, int and float written out; anything else is an error."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(  # noqa: TRY004 -- bad data in a row is always a ValueError
            f"rb.data: {where}, column {column!r}: expected text, got {type(value).__name__} "
            f"{value!r:.80}; give text (or a number) there"
        )
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value)
    if not text.strip():
        raise ValueError(
            f"rb.data: {where}, column {column!r}: text is empty; fill it in, or drop the row"
        )
    return _unicode(text, where, column)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _unicode(text: str, where: str, column: str) -> str:
    """``text``, if it is Unicode a tokenizer can encode: no lone surrogate (U+D800-U+DFFF)."""
    if found := _SURROGATE.search(text):
        raise ValueError(
            f"rb.data: {where}, column {column!r}: character {found.start()} is a lone surrogate "
            f"U+{ord(found.group()):04X}, not valid Unicode (a tokenizer cannot encode it); in "
            f"JSON write the character itself or a full pair such as \\ud83d\\ude00"
        )
    return text
