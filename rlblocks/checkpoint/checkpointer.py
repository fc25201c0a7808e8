"""`Checkpointer`: saves and restores everything a run needs, atomically, keeping the last few.

    ckpt = rb.checkpoint.Checkpointer("runs/grpo/checkpoints", every=10, keep_last=2)
    history = rb.recipes.grpo(..., steps=200,
                              run=rb.run.RunOptions(checkpoint=ckpt, resume="auto"))

Every recipe takes ``checkpoint=`` and ``resume=`` in its ``run=`` (`rlblocks.run.RunOptions`)
and does the rest; by hand::

    ckpt.save(step, {"policy": policy, "data": batches, "kl": controller}, history=history)
    restored = ckpt.load({"policy": policy, "data": batches, "kl": controller})
    restored.step, restored.history       # steps done, their metrics

What a checkpoint holds (folder ``step-{step:08d}``):

- one sub-folder per `Checkpointable` block (the trainers: the policy in the Hugging Face
  format under ``policy/model``, loadable by transformers and vLLM as it is; the optimizer
  sharded through ``torch.distributed.checkpoint``, so a run resumes onto another number of
  workers);
- ``state.pt``: the `Stateful` blocks' ``state_dict()`` (data position, KL controller,
  resharder version, ...), the random state of this process (Python, NumPy, torch, CUDA), the
  step, the metric history and the run configuration;
- ``meta.json``: the step, the time, the blocks and the configuration, readable without torch;
- ``COMPLETE``: written last (`rlblocks.checkpoint.folders`: write, fsync, rename, mark).

Restoring loads the blocks first and the random state last, so that nothing a block does while
loading moves the generators away from where the saved run had them.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from rlblocks.checkpoint.folders import (
    MARKER,
    complete_steps,
    partial_folder,
    publish,
    step_folder,
    sweep,
    to_prune,
)
from rlblocks.checkpoint.lock import FolderLock, locked
from rlblocks.interfaces import Checkpointable, Stateful
from rlblocks.rng import rng_state, set_rng_state

Resume = bool | Literal["auto"]
FORMAT = 1
LOCK = ".checkpointer.lock"
IN_USE = "wait for that run to end (or stop it), or give this run another folder"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the folder and the cause."""


@dataclass(frozen=True)
class Restored:
    """What `Checkpointer.load` put back."""

    step: int
    """Steps done when the checkpoint was taken: the run goes on with step index ``step``."""
    history: list[dict[str, Any]]
    """The metrics of those steps, one dict per step."""
    config: dict[str, Any]
    """The run configuration saved with it."""
    path: Path
    """The checkpoint folder."""


class Checkpointer:
    """Whole-run checkpoints under ``folder`` (module docstring).

    ``every``: `due` says yes every ``every`` steps. ``keep_last``: the newest checkpoints kept
    (None: all); ``keep_every``: also keep every checkpoint whose step is a multiple of it (None:
    none). Older ones are deleted only after a newer one is complete.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        every: int = 1,
        keep_last: int | None = 2,
        keep_every: int | None = None,
    ) -> None:
        if every < 1 or (keep_last is not None and keep_last < 1):
            raise ValueError(
                f"Checkpointer: every={every}, keep_last={keep_last}; use every >= 1 and "
                "keep_last >= 1 (or None to keep every checkpoint)"
            )
        self.root = Path(folder)
        self.every, self.keep_last, self.keep_every = every, keep_last, keep_every
        self.lock = FolderLock(self.root, LOCK, owner="Checkpointer", advice=IN_USE)
        """Held by a run for its whole length, and by every `save` (`rlblocks.checkpoint.lock`)."""

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.root)!r}, every={self.every}, keep_last={self.keep_last})"

    # ------------------------------------------------------------------ finding
    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, ascending."""
        return complete_steps(self.root)

    def latest(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def due(self, step: int) -> bool:
        """Whether a run that has done ``step`` steps saves now (every ``every`` steps)."""
        return step > 0 and step % self.every == 0

    def resume_step(self, resume: Resume) -> int | None:
        """The step to resume from, as ``resume`` asks: False refuses a folder that already
        holds a checkpoint of a step (two runs would mix), True needs one, ``"auto"`` takes the
        newest if there is one. None means start from the beginning. A folder holding at most
        the checkpoint of step 0 (a run that never checkpointed a step) starts over with False
        (`rlblocks.run.resume.start_over`)."""
        latest = self.latest()
        if resume is False and latest:
            raise FileExistsError(
                f"Checkpointer.resume_step: {self.root} already holds checkpoints of a run (the "
                f"newest after step {latest}); pass run=rb.run.RunOptions(resume=True) (or "
                'resume="auto") to continue it, or another folder'
            )
        if resume is True and latest is None:
            raise FileNotFoundError(
                f"Checkpointer.resume_step: resume=True but {self.root} holds no complete "
                "checkpoint: nothing to resume (a run that failed before its first checkpoint "
                'leaves none); start the run over with resume=False (or resume="auto")'
            )
        if resume not in (True, False, "auto"):
            raise ValueError(
                f"Checkpointer.resume_step: resume must be True, False or 'auto', got "
                f"{resume!r}; pass one of them"
            )
        return None if resume is False else latest

    # ------------------------------------------------------------------ saving
    @locked
    def save(
        self,
        step: int,
        blocks: Mapping[str, Any],
        *,
        history: Sequence[Mapping[str, Any]] = (),
        config: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint of ``step`` (steps done) atomically, then prune; returns its
        folder. ``blocks``: name -> `Checkpointable` or `Stateful` (None values are skipped).
        Raises `CheckpointError` if that step is already saved, or if the write fails (e.g. no
        space left): the partial folder is removed and the previous checkpoints stay as they
        were."""
        self.root.mkdir(parents=True, exist_ok=True)
        sweep(self.root)
        if step in self.steps():  # replacing it would leave a moment with no checkpoint of it
            raise CheckpointError(
                f"Checkpointer.save: {step_folder(self.root, step)} is already a checkpoint; "
                "save each step once"
            )
        partial = partial_folder(self.root, step)
        final = step_folder(self.root, step)
        partial.mkdir()
        try:
            kinds = {name: _save_block(name, block, partial) for name, block in _present(blocks)}
            states = {n: b.state_dict() for n, b in _present(blocks) if kinds[n] == "state"}
            payload = {
                "format": FORMAT,
                "step": step,
                "history": [dict(h) for h in history],
                "config": dict(config or {}),
                "rng": rng_state(),
                "blocks": states,
            }
            torch.save(payload, partial / "state.pt")
            meta = {"step": step, "saved_at": time.time(), "blocks": kinds, "config": config}
            (partial / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
            publish(partial, final)
        except Exception as err:  # a full disk may surface as OSError, SafetensorError, ...
            _remove(partial)
            raise CheckpointError(
                f"Checkpointer.save: could not write the checkpoint of step {step} into "
                f"{final}: {err} (the previous checkpoints are untouched: "
                f"{self.steps() or 'none'}); fix the cause (free space, or lower keep_last) and "
                "resume from the newest checkpoint"
            ) from err
        self._prune()
        return final

    def _prune(self) -> None:
        for step in to_prune(self.steps(), keep_last=self.keep_last, keep_every=self.keep_every):
            _remove(step_folder(self.root, step))

    # ------------------------------------------------------------------ loading
    def load(self, blocks: Mapping[str, Any], *, step: int | None = None) -> Restored:
        """Restore ``blocks`` (the same names as saved) and the random state from the checkpoint
        of ``step`` (None: the newest complete one)."""
        step = self.latest() if step is None else step
        path = step_folder(self.root, step) if step is not None else None
        if path is None or not (path / MARKER).is_file():
            raise FileNotFoundError(
                f"Checkpointer.load: no complete checkpoint of step {step} under {self.root}; "
                f"load one of the complete steps {self.steps()}"
            )
        payload = torch.load(path / "state.pt", weights_only=False)  # our own file: numpy RNG
        meta = json.loads((path / "meta.json").read_text())
        saved, given = set(meta["blocks"]), {name for name, _ in _present(blocks)}
        if saved != given:
            raise CheckpointError(
                f"Checkpointer.load: {path} holds the blocks {sorted(saved)}, the run has "
                f"{sorted(given)}; resume with the blocks of the saved run"
            )
        for name, block in _present(blocks):
            if meta["blocks"][name] == "folder":
                block.load_checkpoint(path / name)
            else:
                block.load_state_dict(payload["blocks"][name])
        set_rng_state(payload["rng"])
        return Restored(payload["step"], payload["history"], payload["config"], path)


def warn_if_config_differs(saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """A ``UserWarning`` listing the settings that changed since the checkpoint was saved
    (``steps`` may grow: extending a run is normal)."""
    changed = {
        key: (saved.get(key), now.get(key))
        for key in sorted(set(saved) | set(now))
        if key != "steps" and saved.get(key) != now.get(key)
    }
    if changed:
        what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
        warnings.warn(f"resuming with a different configuration: {what}", UserWarning, stacklevel=3)


def _present(blocks: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [(name, block) for name, block in blocks.items() if block is not None]


def _save_block(name: str, block: Any, partial: Path) -> str:
    """Write a `Checkpointable` block into ``partial/name``; say how the block is kept."""
    if isinstance(block, Checkpointable):
        (partial / name).mkdir()
        block.save_checkpoint(partial / name)
        return "folder"
    if isinstance(block, Stateful):
        return "state"
    raise TypeError(
        f"Checkpointer.save: block {name!r} ({type(block).__name__}) has neither "
        "save_checkpoint/load_checkpoint nor state_dict/load_state_dict; give it one of those "
        "pairs, or leave it out of the checkpoint"
    )


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


__all__ = ["CheckpointError", "Checkpointer", "Restored", "Resume", "warn_if_config_differs"]
