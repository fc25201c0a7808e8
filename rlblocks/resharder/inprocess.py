"""The colocated, single-process Resharder: trainer and engine live in the same Python process.

Two cases, picked by looking at the objects, not by a flag:

- **Shared module.** The HF engine was built on the trainer's own model (``HFEngine(policy.model,
  tokenizer)``): the engine already sees every update, nothing is copied. ``sync`` only records
  the new weight version, so staleness is still tracked.
- **Separate copy.** The engine holds its own model (another dtype, a vLLM engine, ...): the
  trainer's full weights are streamed into it with ``engine.update_weights`` under their Hugging
  Face names, one tensor at a time, so no second full copy is built in between.
"""

from __future__ import annotations

import time

from rlblocks.interfaces import PolicyTrainer, RolloutEngine


class InProcessResharder:
    """Pushes a trainer's weights into an engine in the same process; tracks the version."""

    def __init__(self) -> None:
        self.version = 0

    def sync(self, trainer: PolicyTrainer, engine: RolloutEngine) -> dict[str, float]:
        start = time.perf_counter()
        self.version += 1
        moved = 0
        if _shares_module(trainer, engine):
            engine.update_weights((), version=self.version)
        else:
            counted = _Counting(trainer.named_weights())
            engine.update_weights(counted, version=self.version)
            moved = counted.bytes
        return {
            "sync/seconds": time.perf_counter() - start,
            "sync/bytes": float(moved),
            "sync/version": float(self.version),
        }

    def state_dict(self) -> dict[str, int]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.version = int(state["version"])


def _shares_module(trainer: object, engine: object) -> bool:
    model = getattr(trainer, "model", None)
    return model is not None and getattr(engine, "model", None) is model


class _Counting:
    """Iterates ``(name, tensor)`` pairs while adding up their size in bytes."""

    def __init__(self, weights):
        self._weights = weights
        self.bytes = 0

    def __iter__(self):
        for name, tensor in self._weights:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor
