"""``Resharder``: after each update, the trainer's weights go into the rollout engine in buckets.

One object for every placement, picked by looking at the trainer and the engine:

- **Shared module** (``HFEngine(policy.model, ...)`` in one process): the engine already sees
  every update; only the weight version is recorded.
- **Separate copy, same process**: ``trainer.named_weights()`` is streamed into
  ``engine.update_weights`` in buckets of about ``bucket_mb`` megabytes (one call per bucket).
  For a sharded (FSDP) trainer each tensor is all-gathered just before it joins a bucket and
  dropped once the bucket is loaded, so a worker holds its shards, the engine's copy and one
  bucket, never a second full model.
- **LoRA adapter only**: a peft LoRA policy and an engine that serves adapters itself
  (``VLLMEngine(..., enable_lora=True)``): the adapter is saved (peft's ``save_pretrained``,
  adapter weights and config only) and the engine loads it; the base weights never move.
- **Worker groups** (``rlblocks.placement.Ray``): the trainer handle's ``sync_weights_with``
  runs :meth:`Resharder.push` inside each colocated worker, or moves the buckets through Ray's
  object store when the engine has its own pool. This module knows nothing of Ray.

Metrics: ``sync/seconds``, ``sync/bytes`` (bytes written into engines, summed over workers),
``sync/version``.
"""

from __future__ import annotations

import inspect
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from torch import Tensor

from rlblocks.interfaces import PolicyTrainer, RolloutEngine

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
        raise ValueError(f"buckets: bucket_bytes must be >= 1, got {bucket_bytes}")
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


def trainer_weights(trainer: Any, bucket_bytes: int) -> Weights:
    """``trainer.named_weights()``, asked to gather its shards in buckets of ``bucket_bytes``
    when it takes ``bucket_mb`` (a sharded ``PolicyTrainer`` does)."""
    if "bucket_mb" in inspect.signature(trainer.named_weights).parameters:
        return trainer.named_weights(bucket_mb=bucket_bytes / 2**20)
    return trainer.named_weights()


class Resharder:
    """Pushes a trainer's weights into a rollout engine; tracks the weight version."""

    def __init__(self, *, bucket_mb: float = 256.0) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"Resharder: bucket_mb must be > 0, got {bucket_mb}")
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.version = 0
        self._adapters: tempfile.TemporaryDirectory | None = None  # LoRA adapters, by version

    def sync(self, trainer: PolicyTrainer, engine: RolloutEngine) -> dict[str, float]:
        """Give ``engine`` the trainer's current weights; metrics back (module docstring)."""
        self.version += 1
        across = getattr(trainer, "sync_weights_with", None)
        if across is not None:  # a worker-group handle moves the weights between its workers
            return across(engine, self)
        return self.push(trainer, engine, version=self.version)

    def push(self, trainer: Any, engine: Any, *, version: int) -> dict[str, float]:
        """Copy the weights of ``trainer`` into ``engine`` in this process, bucket by bucket."""
        start = time.perf_counter()
        moved, count = 0, 0
        if _shares_module(trainer, engine):
            engine.update_weights((), version=version)
        elif _adapter_only(trainer, engine):
            moved, count = self._push_adapter(trainer, engine, version), 1
        else:
            for bucket in buckets(trainer_weights(trainer, self.bucket_bytes), self.bucket_bytes):
                engine.update_weights(bucket, version=version)
                moved += sum(t.numel() * t.element_size() for _, t in bucket)
                count += 1
        return {
            "sync/seconds": time.perf_counter() - start,
            "sync/bytes": float(moved),
            "sync/buckets": float(count),
            "sync/version": float(version),
        }

    def _push_adapter(self, trainer: Any, engine: Any, version: int) -> int:
        """Save the LoRA adapter (peft's ``save_pretrained``: adapter weights and config only)
        into a fresh folder, point the engine at it, drop the previous folder; its bytes back."""
        if self._adapters is None:
            self._adapters = tempfile.TemporaryDirectory(prefix="rlblocks-adapter-")
        folder = Path(self._adapters.name) / f"v{version}"
        trainer.model.save_pretrained(folder)
        engine.load_adapter(folder, version=version)
        for old in Path(self._adapters.name).iterdir():
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))

    def state_dict(self) -> dict[str, int]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.version = int(state["version"])


def _adapter_only(trainer: object, engine: object) -> bool:
    """A LoRA policy and an engine that serves adapters itself: send the adapter, not W + BA."""
    from rlblocks.trainer.lora import is_peft_model

    model = getattr(trainer, "model", None)
    return is_peft_model(model) and bool(getattr(engine, "lora_enabled", False))


def _shares_module(trainer: object, engine: object) -> bool:
    model = getattr(trainer, "model", None)
    return model is not None and getattr(engine, "model", None) is model
