"""The prompt dataset type: `PromptRow` and `PromptDataset`.

Its own module so that `load_prompts` (which builds datasets and cuts them to length) and
`limit_prompt_length` (which reads and returns datasets) both import it, and neither the other's
module back: ``prompts -> length -> dataset``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from rlblocks.interfaces import Prompt

__all__ = ["PromptDataset", "PromptRow"]


@dataclass(frozen=True)
class PromptRow:
    """One prompt: what the engine is fed, the reference answer, and what rewards read."""

    prompt: str | Sequence[Mapping[str, Any]]
    """Raw text, or chat messages ``[{"role": ..., "content": ...}, ...]``."""
    ground_truth: str | None
    """The reference answer as text, or None for unlabelled prompts."""
    metadata: dict[str, Any]
    """``ground_truth``, ``data_source`` and the kept columns; copied onto every rollout row."""
    index: int
    """Row index in the source, for error messages and for reporting filtered rows."""


class PromptDataset(Sequence[PromptRow]):
    """A list of `PromptRow` with the source indices of the rows a length filter dropped."""

    def __init__(self, rows: Iterable[PromptRow], *, dropped: Sequence[int] = ()) -> None:
        self.rows = list(rows)
        self.dropped = list(dropped)  # source indices of rows removed by overlong="filter"

    @property
    def num_dropped(self) -> int:
        """How many source rows were dropped for being too long."""
        return len(self.dropped)

    @property
    def prompts(self) -> list[Prompt]:
        """The prompts, in order: ``engine.generate(ds.prompts, ...)``."""
        return [row.prompt for row in self.rows]

    @property
    def ground_truths(self) -> list[str | None]:
        """The reference answers, in order (None for unlabelled rows)."""
        return [row.ground_truth for row in self.rows]

    @property
    def metadata(self) -> list[dict[str, Any]]:
        """One metadata dict per row: ``engine.generate(..., metadata=ds.metadata)``."""
        return [row.metadata for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, key: int) -> PromptRow: ...
    @overload
    def __getitem__(self, key: slice) -> PromptDataset: ...
    def __getitem__(self, key: int | slice) -> PromptRow | PromptDataset:
        if isinstance(key, slice):
            return PromptDataset(self.rows[key], dropped=self.dropped)
        return self.rows[key]

    def __iter__(self) -> Iterator[PromptRow]:
        return iter(self.rows)

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} rows, {self.num_dropped} dropped)"
