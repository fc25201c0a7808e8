"""Batches for training steps: deterministic shuffling with an exactly resumable position.

    batches = rb.data.PromptBatches(dataset, prompts_per_step=8, seed=0)
    for batch in batches:
        ro = engine.generate(batch.prompts, group_size=4, metadata=batch.metadata)
        ...
        checkpoint["data"] = batches.state_dict()   # {"epoch": 3, "position": 16, ...}

Epoch ``e`` visits the rows in the order ``permutation(len(dataset))`` drawn from a NumPy
generator seeded with ``(seed, e)``, so every epoch is reshuffled, the order of any epoch can be
recomputed on its own, and a run resumed from ``state_dict()`` (epoch, position) yields exactly
the batch it would have yielded next. With ``drop_last=True`` the rows left over at the end of
an epoch (fewer than ``prompts_per_step``) are skipped, and they differ from epoch to epoch
because the order does. Iteration is endless unless ``epochs`` is given.

`SFTBatches` does the same over an `rlblocks.data.sft.SFTData` and yields padded `Rollouts`
batches for ``policy.step``; it keeps the last, smaller batch by default (``drop_last=False``)
so that every example is trained on once an epoch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from rlblocks.data.dataset import PromptRow
from rlblocks.interfaces import Prompt

if TYPE_CHECKING:
    from rlblocks.data.sft import SFTData
    from rlblocks.rollouts import Rollouts

__all__ = ["PromptBatch", "PromptBatches", "SFTBatches"]


def _epoch_order(num_rows: int, *, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The row indices of ``epoch`` in visiting order, ``(n)`` int64: ``permutation(n)`` of a
    NumPy generator seeded with ``(seed, epoch)``, or ``arange(n)`` without ``shuffle``."""
    if not shuffle:
        return np.arange(num_rows)
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


class _EpochBatches:
    """The bookkeeping `PromptBatches` and `SFTBatches` share: epoch, position, the order of an
    epoch, the end of an epoch and of the iteration, and ``state_dict`` (module docstring).
    A subclass says what it batches and its settings (`_start`), names its batch size
    (`_size_key`) and turns the indices of `_next_indices` into a batch."""

    _size_key: str  # the name of the batch size in ``state_dict``

    def _start(
        self, items: Sized, size: int, seed: int, shuffle: bool, drop_last: bool, epochs: int | None
    ) -> None:
        """Batch ``size`` of ``items`` at a time with these settings, from the first epoch."""
        self._source, self._batch_size = items, size
        self.seed, self.shuffle, self.drop_last, self.epochs = seed, shuffle, drop_last, epochs
        self.epoch = 0
        self.position = 0  # index, in this epoch's order, of the next item to yield
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation) cache

    def _items(self) -> int:
        return len(self._source)

    def _size(self) -> int:
        return self._batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Batches in one epoch: ``⌊n / b⌋`` with ``drop_last``, else ``⌈n / b⌉``."""
        n, b = self._items(), self._size()
        return n // b if self.drop_last else -(-n // b)

    @property
    def epochs_drawn(self) -> float:
        """Epochs drawn so far, fractional: ``epoch + position / n`` (the run loop reports it;
        TRL's ``trainer_state.epoch`` is this number)."""
        return self.epoch + self.position / self._items()

    def __len__(self) -> int:
        """Batches in the whole iteration, from the start; only with ``epochs`` set."""
        if self.epochs is None:
            raise TypeError(
                f"{type(self).__name__}: epochs=None is endless and has no len(); pass epochs=k "
                "for a finite iteration"
            )
        return self.epochs * self.steps_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        """The indices of ``epoch`` in visiting order, ``(n)`` int64."""
        if self._order is None or self._order[0] != epoch:
            order = _epoch_order(self._items(), seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            self._order = (epoch, order)
        return self._order[1]

    def __iter__(self) -> Self:
        return self

    def _next_indices(self) -> tuple[np.ndarray, int]:
        """The indices of the next batch and its start in the epoch's order; moves on to the
        next epoch at the end of one, ``StopIteration`` after the last."""
        n, b = self._items(), self._size()
        left = n - self.position
        if left == 0 or (self.drop_last and left < b):
            self.epoch, self.position = self.epoch + 1, 0
        if self.epochs is not None and self.epoch >= self.epochs:
            raise StopIteration
        start = self.position
        indices = self.order(self.epoch)[start : start + b]
        self.position = start + len(indices)
        return indices, start

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands, plus the settings it must be resumed with."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": self._items(),
            self._size_key: self._size(),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state["epoch"]``, ``state["position"]``; the next batch is the one the
        saved run would have yielded next. Raises ``ValueError`` if the data size or a setting
        differs (the order would silently differ)."""
        ours = self.state_dict()
        for key in ("seed", "num_rows", self._size_key, "shuffle", "drop_last"):
            if key in state and state[key] != ours[key]:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: cannot resume, saved "
                    f"{key}={state[key]!r}, this one has {ours[key]!r}; build it with the "
                    "settings of the saved run"
                )
        if not 0 <= state["position"] <= self._items():
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: position {state['position']} outside "
                f"0..{self._items()}; load a state saved from the same data"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


@dataclass(frozen=True)
class PromptBatch:
    """The prompts of one RL step, ready for ``engine.generate(batch.prompts, ...)``."""

    rows: tuple[PromptRow, ...]
    epoch: int
    """The epoch the rows come from (0-based)."""
    step: int
    """The index of this batch within its epoch (0-based)."""

    @property
    def prompts(self) -> list[Prompt]:
        """The prompts, in order: ``engine.generate(ds.prompts, ...)``."""
        return [row.prompt for row in self.rows]

    @property
    def metadata(self) -> list[dict[str, Any]]:
        """One metadata dict per row: ``engine.generate(..., metadata=ds.metadata)``."""
        return [row.metadata for row in self.rows]

    @property
    def ground_truths(self) -> list[str | None]:
        """The reference answers, in order (None for unlabelled rows)."""
        return [row.ground_truth for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)


class PromptBatches(_EpochBatches):
    """An iterator of `PromptBatch` over a dataset, epoch after epoch; see the module docstring.

    Args:
        dataset: a `PromptDataset` or any sequence of `PromptRow`.
        prompts_per_step: rows per batch (``p`` in the shape vocabulary).
        seed: the shuffling seed; epoch ``e`` uses the permutation seeded with ``(seed, e)``.
        shuffle: False visits the rows in dataset order every epoch.
        drop_last: skip the last, smaller batch of an epoch (keeps every step the same size).
        epochs: stop after this many epochs; None iterates forever.
    """

    def __init__(
        self,
        dataset: Sequence[PromptRow],
        *,
        prompts_per_step: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        epochs: int | None = None,
    ) -> None:
        if prompts_per_step < 1:
            raise ValueError(
                f"PromptBatches: prompts_per_step must be >= 1, got {prompts_per_step}; pass a "
                "positive count"
            )
        if drop_last and len(dataset) < prompts_per_step:
            raise ValueError(
                f"PromptBatches: the dataset has {len(dataset)} rows, fewer than "
                f"prompts_per_step={prompts_per_step}, so with drop_last=True no batch would ever "
                "be full; lower prompts_per_step, or pass drop_last=False"
            )
        if len(dataset) == 0:
            raise ValueError("PromptBatches: the dataset is empty; give it at least one row")
        self.dataset = dataset
        self.prompts_per_step = prompts_per_step
        self._start(dataset, prompts_per_step, seed, shuffle, drop_last, epochs)

    _size_key = "prompts_per_step"

    def __next__(self) -> PromptBatch:
        indices, start = self._next_indices()
        rows = tuple(self.dataset[int(i)] for i in indices)
        return PromptBatch(rows=rows, epoch=self.epoch, step=start // self.prompts_per_step)


class SFTBatches(_EpochBatches):
    """An iterator of `Rollouts` batches over an `SFTData`, epoch after epoch, in the order
    and with the resumable position of `PromptBatches` (module docstring).

        for batch in SFTBatches(data, batch_size=8, epochs=3):
            logs = policy.step(batch, zeros, loss_fn=nll)

    Args:
        data: the tokenized examples (`rlblocks.data.sft_data`).
        batch_size: examples per batch (``b``).
        seed: the shuffling seed; epoch ``e`` uses the permutation seeded with ``(seed, e)``.
        epochs: stop after this many epochs; None iterates forever.
        shuffle: False visits the examples in dataset order every epoch.
        drop_last: skip the last, smaller batch of an epoch (default: keep it).
    """

    def __init__(
        self,
        data: SFTData,
        *,
        batch_size: int,
        seed: int = 0,
        epochs: int | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(
                f"SFTBatches: batch_size must be >= 1, got {batch_size}; pass a positive count"
            )
        if len(data) == 0:
            raise ValueError("SFTBatches: the SFT data is empty; give it at least one example")
        if drop_last and len(data) < batch_size:
            raise ValueError(
                f"SFTBatches: the SFT data has {len(data)} examples, fewer than "
                f"batch_size={batch_size}, so with drop_last=True no batch would ever be full; "
                "lower batch_size, or pass drop_last=False"
            )
        self.data, self.batch_size = data, batch_size
        self._start(data, batch_size, seed, shuffle, drop_last, epochs)

    _size_key = "batch_size"

    def __next__(self) -> Rollouts:
        indices, _ = self._next_indices()
        return self.data.rollouts(indices.tolist())
