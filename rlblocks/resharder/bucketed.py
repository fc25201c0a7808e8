"""``Resharder``: after each update, the trainer's weights go into the rollout engine.

The resharder alone decides what moves, from what the Protocols state (``rlblocks.interfaces``)
and nothing probed (:func:`copy_weights`):

- **Shared module** (``engine.model is trainer.model``: ``HFEngine(policy.model, ...)`` in one
  process): the engine already sees every update; only the weight version is recorded.
- **LoRA adapter only** (``trainer.has_adapter`` and ``engine.serves_adapters``: a peft LoRA
  policy and ``VLLMEngine(..., enable_lora=True)``): the adapter is saved (peft's
  ``save_pretrained``, adapter weights and config only) and the engine loads it; the base
  weights never move.
- **Buckets** otherwise: ``trainer.named_weights(bucket_bytes=...)`` is streamed into
  ``engine.update_weights`` in buckets of about ``bucket_mb`` megabytes that never split a
  decoder layer (one call per bucket). A sharded (FSDP) trainer all-gathers each bucket just
  before it is loaded, so a worker holds its shards, the engine's copy and one bucket, never a
  second full model.

Before anything moves (every case but the shared module), the whole transfer is checked
(``rlblocks.resharder.strict``): the trainer's ``weight_spec`` against the engine's (names both
ways, shapes, dtypes: float-to-float casts allowed) and the two tokenizers (vocabulary, BOS /
EOS / padding ids), see :meth:`Resharder.check` for when. A mismatch raises ``ValueError``
naming the first differing tensors, and the engine is untouched.

Blocks in other processes (``rlblocks.placement.Ray``) are reached through the one thing a
placement's handle offers for this (``Handle.run_with``): the same :func:`copy_weights` runs
where the trainer lives, next to a colocated engine, or with a stand-in whose calls the
placement carries to the engine's own workers (a split layout). This module knows nothing of
Ray, of the trainer classes or of the engines.

Metrics: ``sync/seconds``, ``sync/bytes`` (bytes the trainer side handed to engines: summed over
colocated workers; sent once into a split pool), ``sync/buckets``, ``sync/version``.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

from torch import Tensor

from rlblocks.interfaces import Handle, PolicyTrainer, RolloutEngine
from rlblocks.resharder.strict import check_tokenizers, check_weights

Weights = Iterable[tuple[str, Tensor]]


def buckets(weights: Weights, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """``(name, tensor)`` pairs grouped into lists of about ``bucket_bytes`` bytes, in order,
    never splitting a layer.

    Tensors of one decoder layer (names sharing a ``….layers.<i>.`` prefix) stay in one bucket:
    vLLM reloads a layer's fused q/k/v and gate/up projections from the pieces it receives in
    one call, so half a layer in one bucket and half in the next would lose a piece. A layer
    (or any single tensor) larger than the budget is a bucket of its own.
    """
    if bucket_bytes < 1:
        raise ValueError(
            f"buckets: bucket_bytes must be >= 1, got {bucket_bytes}; pass a positive size"
        )
    bucket: list[tuple[str, Tensor]] = []
    group: list[tuple[str, Tensor]] = []
    size = group_size = 0
    group_key = None
    for name, tensor in weights:
        key = _layer_of(name)
        if group and (key is None or key != group_key):
            if bucket and size + group_size > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.extend(group)
            size += group_size
            group, group_size = [], 0
        group.append((name, tensor))
        group_size += tensor.numel() * tensor.element_size()
        group_key = key
    if group:
        if bucket and size + group_size > bucket_bytes:
            yield bucket
            bucket = []
        bucket.extend(group)
    if bucket:
        yield bucket


_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def _layer_of(name: str) -> str | None:
    match = _LAYER.match(name)
    return match.group(1) if match else None


class Resharder:
    """Pushes a trainer's weights into a rollout engine; tracks the weight version."""

    def __init__(self, *, bucket_mb: float = 256.0) -> None:
        if bucket_mb <= 0:
            raise ValueError(
                f"Resharder: bucket_mb must be > 0, got {bucket_mb}; pass a positive size in MiB"
            )
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.version = 0
        self._checked: set[tuple[int, int]] = set()  # (id(trainer), id(engine)) that passed

    def sync(self, trainer: PolicyTrainer, engine: RolloutEngine) -> dict[str, float]:
        """Give ``engine`` the trainer's current weights; metrics back (module docstring)."""
        self.version += 1
        return self._send(trainer, engine)

    def resync(self, trainer: PolicyTrainer, engine: RolloutEngine) -> dict[str, float]:
        """Send the trainer's weights again under the current version: after a run resumed
        from a checkpoint, the engine was built with the initial weights, the trainer and this
        resharder (its ``version``) were restored."""
        return self._send(trainer, engine)

    def check(self, trainer: PolicyTrainer, engine: RolloutEngine) -> None:
        """Raise ``ValueError`` unless the trainer's weights fit the engine (names both ways,
        shapes, dtypes) and their tokenizers agree (module docstring). Nothing to check for a
        shared module.

        In one process the weights are checked at every sync (metadata only: a dict compare);
        the tokenizers once per trainer and engine. Through a placement's handle each answer
        is a round trip to rank 0 (four in all), so a pair is checked once: a block behind a
        handle changes its model only by being built again, which gives a new handle."""
        if _shares_module(trainer, engine):
            return
        pair = (id(trainer), id(engine))
        remote = isinstance(trainer, Handle) or isinstance(engine, Handle)
        if pair in self._checked and remote:
            return
        if pair not in self._checked:
            check_tokenizers(trainer.tokenizer, engine.tokenizer)
        held = engine.weight_spec()
        if held is not None:  # an engine that declares nothing takes any stream
            check_weights(trainer.weight_spec(), held)
        self._checked.add(pair)

    def _send(self, trainer: PolicyTrainer, engine: RolloutEngine) -> dict[str, float]:
        start = time.perf_counter()
        self.check(trainer, engine)
        move = partial(copy_weights, version=self.version, bucket_bytes=self.bucket_bytes)
        if isinstance(trainer, Handle):  # the trainer lives in worker processes: go there
            results = trainer.run_with(move, engine)
        else:
            results = [move(trainer, engine)]
        return {
            "sync/seconds": time.perf_counter() - start,
            "sync/bytes": float(sum(moved for moved, _ in results)),
            "sync/buckets": float(results[0][1]),
            "sync/version": float(self.version),
        }

    def state_dict(self) -> dict[str, int]:
        """The weight version (the number of syncs so far)."""
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the weight version saved by ``state_dict``."""
        self.version = int(state["version"])


def copy_weights(
    trainer: PolicyTrainer, engine: RolloutEngine, *, version: int, bucket_bytes: int
) -> tuple[int, int]:
    """Copy ``trainer``'s weights into ``engine`` in this process: shared module, adapter only,
    or buckets (module docstring). Returns ``(bytes handed to the engine, buckets)``.

    Nothing is checked here (the engine may be a placement's stand-in that knows no spec):
    :meth:`Resharder.check` runs first, where both blocks answer."""
    if _shares_module(trainer, engine):
        engine.update_weights((), version=version)  # it already has them
        return 0, 0
    if trainer.has_adapter and engine.serves_adapters:
        return _copy_adapter(trainer, engine, version), 1
    moved = count = 0
    for bucket in buckets(trainer.named_weights(bucket_bytes=bucket_bytes), bucket_bytes):
        engine.update_weights(bucket, version=version)
        moved += sum(t.numel() * t.element_size() for _, t in bucket)
        count += 1
    return moved, count


def _shares_module(trainer: PolicyTrainer, engine: RolloutEngine) -> bool:
    """The engine samples with the trainer's own module (one process): nothing to move. A
    block behind a handle never shares (its module is in its workers; none is read here)."""
    if isinstance(trainer, Handle) or isinstance(engine, Handle):
        return False
    return engine.model is not None and engine.model is trainer.model


_ADAPTERS: list[tempfile.TemporaryDirectory] = []  # one folder per process, removed at exit


def _copy_adapter(trainer: PolicyTrainer, engine: RolloutEngine, version: int) -> int:
    """Save the LoRA adapter into a fresh folder of this process, point the engine at it, drop
    the trainer's previous folder; the adapter's bytes back. (The engine reads the folder at
    its next ``generate``, so the folder must outlive this call: it is the process's.)"""
    if not _ADAPTERS:
        _ADAPTERS.append(tempfile.TemporaryDirectory(prefix="rlblocks-adapter-"))
    root = Path(_ADAPTERS[0].name)
    folder = root / f"{id(trainer)}-v{version}"
    trainer.save_adapter(folder)
    engine.load_adapter(folder, version=version)
    for old in root.glob(f"{id(trainer)}-v*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))
