"""The prompt dataset type: `PromptRow` and `PromptDataset`.

Its own module so that `load_prompts` (which builds datasets and cuts them to length) and
`limit_prompt_length` (which reads and returns datasets) both import it, and neither the other's
module back: ``prompts -> length -> dataset``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar, overload

from rlblocks.interfaces import Prompt

__all__ = ["PromptDataset", "PromptRow"]

T = TypeVar("T")


class _Kept(Sequence[T]):
    """The rows a length filter kept, and the source indices of those it dropped: the sequence
    part of `PromptDataset` and `SFTData`, which name their rows ``_noun`` and give them by
    ``_items`` (``rows``, ``examples``), the same kind over a slice of them by ``_sliced``."""

    _noun = "rows"
    dropped: Sequence[int]  # source indices of rows removed by overlong="filter"

    def _items(self) -> list[T]:
        raise NotImplementedError

    def _sliced(self, items: list[T]) -> Self:
        raise NotImplementedError

    @property
    def num_dropped(self) -> int:
        """How many source rows were dropped for being too long."""
        return len(self.dropped)

    def __len__(self) -> int:
        return len(self._items())

    @overload
    def __getitem__(self, key: int) -> T: ...
    @overload
    def __getitem__(self, key: slice) -> Self: ...
    def __getitem__(self, key: int | slice) -> T | Self:
        items = self._items()
        return self._sliced(items[key]) if isinstance(key, slice) else items[key]

    def __iter__(self) -> Iterator[T]:
        return iter(self._items())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} {self._noun}, {self.num_dropped} dropped)"


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


class PromptDataset(_Kept[PromptRow]):
    """A list of `PromptRow` with the source indices of the rows a length filter dropped."""

    def __init__(self, rows: Iterable[PromptRow], *, dropped: Sequence[int] = ()) -> None:
        self.rows = list(rows)
        self.dropped = list(dropped)  # source indices of rows removed by overlong="filter"

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

    def _items(self) -> list[PromptRow]:
        return self.rows

    def _sliced(self, items: list[PromptRow]) -> PromptDataset:
        return PromptDataset(items, dropped=self.dropped)
