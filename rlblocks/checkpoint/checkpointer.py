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
- ``state.json`` and ``state.safetensors``: the `Stateful` blocks' ``state_dict()`` (data
  position, KL controller, resharder version, the batch sampled ahead, ...), the random state
  of this process (Python, NumPy, torch, CUDA), the step, the metric history and the run
  configuration, as data (`rlblocks.base.statefile`: JSON, tensors in safetensors; nothing in a
  checkpoint is unpickled, so nothing in it can run code);
- ``meta.json``: the format, the step, the time, the blocks and the configuration;
- ``manifest.json``: every file's size and SHA-256 (`rlblocks.checkpoint.integrity`);
- ``COMPLETE``: written last (`rlblocks.checkpoint.folders`: write, fsync, rename, mark).

A save is refused (`CheckpointError`, and nothing is published) when a block's weights hold
NaN or ±inf, and when any write fails: the error names the file, and the partial folder is
removed whatever was raised (torch's DCP raises a ``BaseException``).

Loading checks the newest checkpoint against its manifest first: a damaged one (changed bytes,
a truncated or missing file) is named in a warning, moved aside to ``damaged-step-…`` (so that
the resumed run can save those steps again) and the next newest is tried; when none is intact
the error names every damaged file. A checkpoint of an older rlblocks (a pickled ``state.pt``)
is refused by name. Restoring loads the blocks first and the random state last, so that
nothing a block does while loading moves the generators away from where the saved run had
them.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlblocks.base.rng import rng_state, set_rng_state
from rlblocks.base.safe_files import UnsafeFile, read_json
from rlblocks.base.statefile import StateFileError, read_state, write_state
from rlblocks.checkpoint.folders import (
    MARKER,
    complete_steps,
    partial_folder,
    publish,
    step_folder,
    sweep,
    to_prune,
)
from rlblocks.checkpoint.integrity import damage, first_nonfinite, write_manifest
from rlblocks.checkpoint.lock import FolderLock, locked
from rlblocks.interfaces import Checkpointable, Stateful

Resume = bool | Literal["auto"]
#: 1: ``state.pt`` (pickle); 2: ``state.json`` + ``.safetensors``, a manifest of checksums.
FORMAT = 2
STATE = "state.json"
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
        Raises `CheckpointError` if that step is already saved, if a block's weights hold NaN
        or ±inf, or if the write fails (e.g. no space left, naming the file): the partial
        folder is removed and the previous checkpoints stay as they were."""
        self.root.mkdir(parents=True, exist_ok=True)
        sweep(self.root)
        if step in self.steps():  # replacing it would leave a moment with no checkpoint of it
            raise CheckpointError(
                f"Checkpointer.save: {step_folder(self.root, step)} is already a checkpoint; "
                "save each step once"
            )
        partial = partial_folder(self.root, step)
        partial.mkdir()
        try:
            self._write(partial, step, blocks, history, config)
            publish(partial, step_folder(self.root, step))
        except BaseException as err:  # DCP raises a BaseException (CheckpointException)
            failed = self._failed(step, partial, err)
            _remove(partial)
            if isinstance(err, KeyboardInterrupt | SystemExit | CheckpointError):
                raise
            raise failed from err
        self._prune()
        return step_folder(self.root, step)

    def _write(
        self,
        partial: Path,
        step: int,
        blocks: Mapping[str, Any],
        history: Sequence[Mapping[str, Any]],
        config: Mapping[str, Any] | None,
    ) -> None:
        """Every file of the checkpoint of ``step`` into ``partial``, the manifest last."""
        kinds = {name: _save_block(name, block, partial) for name, block in _present(blocks)}
        self._refuse_nonfinite(partial, step, [n for n, kind in kinds.items() if kind == "folder"])
        states = {n: b.state_dict() for n, b in _present(blocks) if kinds[n] == "state"}
        payload = {
            "format": FORMAT,
            "step": step,
            "history": [dict(h) for h in history],
            "config": dict(config or {}),
            "rng": rng_state(),
            "blocks": states,
        }
        write_state(partial / STATE, payload)
        meta = {
            "format": FORMAT,
            "step": step,
            "saved_at": time.time(),
            "blocks": kinds,
            "config": config,
        }
        (partial / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        write_manifest(partial)

    def _refuse_nonfinite(self, partial: Path, step: int, folders: list[str]) -> None:
        found = first_nonfinite(partial / name for name in folders)
        if found is not None:
            raise CheckpointError(
                f"Checkpointer.save: the checkpoint of step {step} would hold non-finite weights: "
                f"{found.tensor!r} in {found.file.relative_to(partial)} has {found.count} NaN/inf "
                f"values of {found.numel} (nothing saved; the previous checkpoints are "
                f"{self.steps() or 'none'}); the run diverged before step {step}: resume from "
                "an earlier checkpoint with a lower learning rate (docs/troubleshooting.md)"
            )

    def _failed(self, step: int, partial: Path, err: BaseException) -> CheckpointError:
        """The error of a write that failed: the file it failed in, the cause, what is left."""
        file = getattr(err, "filename", None) or _newest_file(partial)
        cause = str(err).splitlines()[0] if str(err) else type(err).__name__
        where = f" while writing {file}" if file and str(file) not in cause else ""
        return CheckpointError(
            f"Checkpointer.save: could not write the checkpoint of step {step}{where}: "
            f"{type(err).__name__}: {cause} (nothing was published; the previous checkpoints are "
            f"untouched: {self.steps() or 'none'}); fix the cause (free space, or lower "
            "keep_last) and resume from the newest checkpoint"
        )

    def _prune(self) -> None:
        for step in to_prune(self.steps(), keep_last=self.keep_last, keep_every=self.keep_every):
            _remove(step_folder(self.root, step))

    # ------------------------------------------------------------------ loading
    def load(self, blocks: Mapping[str, Any], *, step: int | None = None) -> Restored:
        """Restore ``blocks`` (the same names as saved) and the random state from the checkpoint
        of ``step``, or (None) from the newest intact one: a damaged newer one is named in a
        warning and moved aside (module docstring). Raises `CheckpointError` naming the damaged
        files, or the file that is not data."""
        path = self._intact(step)
        meta = read_json(path / "meta.json")  # checked by _intact: a mapping of this step
        saved, given = set(meta["blocks"]), {name for name, _ in _present(blocks)}
        if saved != given:
            raise CheckpointError(
                f"Checkpointer.load: {path} holds the blocks {sorted(saved)}, the run has "
                f"{sorted(given)}; resume with the blocks of the saved run"
            )
        try:
            payload = read_state(path / STATE)
            for name, block in _present(blocks):
                if meta["blocks"][name] == "folder":
                    block.load_checkpoint(path / name)
                else:
                    block.load_state_dict(payload["blocks"][name])
        except StateFileError as err:
            raise CheckpointError(f"Checkpointer.load: in {path}: {err}") from None
        except Exception as err:
            if type(err).__name__ != "SafetensorError":  # safetensors' own, whatever its module
                raise
            raise CheckpointError(
                f"Checkpointer.load: in {path}: a .safetensors file is not what its header says "
                f"({err}); resume from another checkpoint (Checkpointer.load(step=...))"
            ) from None
        set_rng_state(payload["rng"])
        return Restored(payload["step"], payload["history"], payload["config"], path)

    def _intact(self, step: int | None) -> Path:
        """The folder to load: ``step``'s, refused if damaged; else the newest intact one."""
        steps = self.steps() if step is None else [step]
        if not steps or not (step_folder(self.root, steps[-1]) / MARKER).is_file():
            raise FileNotFoundError(
                f"Checkpointer.load: no complete checkpoint of step {step} under {self.root}; "
                f"load one of the complete steps {self.steps()}"
            )
        damaged: dict[int, list[str]] = {}
        for candidate in reversed(steps):
            path = step_folder(self.root, candidate)
            _refuse_old(path)
            found = damage(path) or _meta_damage(path, candidate)
            if not found:
                self._set_aside(damaged, candidate)
                return path
            damaged[candidate] = found
            warnings.warn(
                f"Checkpointer.load: the checkpoint of step {candidate} is damaged: "
                f"{'; '.join(found)}; trying the one before it",
                UserWarning,
                stacklevel=3,
            )
        listed = "; ".join(f"step {s}: {', '.join(files)}" for s, files in damaged.items())
        raise CheckpointError(
            f"Checkpointer.load: no intact checkpoint under {self.root}: {listed}; restore these "
            "files from a copy, or start the run again in a new folder"
        )

    def _set_aside(self, damaged: Mapping[int, list[str]], resumed: int) -> None:
        """Move the damaged checkpoints newer than ``resumed`` to ``damaged-step-…`` (kept for
        a look, out of the steps, so that the resumed run saves those steps again)."""
        for step in damaged:
            folder = step_folder(self.root, step)
            aside = self.root / f"damaged-{folder.name}"
            n = 1
            while aside.exists():
                n += 1
                aside = self.root / f"damaged-{folder.name}-{n}"
            os.rename(folder, aside)
            warnings.warn(
                f"Checkpointer.load: resuming from step {resumed}, the newest intact checkpoint; "
                f"the damaged checkpoint of step {step} is moved to {aside}",
                UserWarning,
                stacklevel=4,
            )


def _meta_damage(path: Path, step: int) -> list[str]:
    """What is wrong with ``path/meta.json`` for a checkpoint of ``step``: not a bounded JSON
    mapping, no ``blocks`` mapping, or another step than the folder's name says (a folder
    copied or renamed into another step's place)."""
    try:
        meta = read_json(path / "meta.json")
    except UnsafeFile as err:
        return [str(err)]
    if not isinstance(meta, dict) or not isinstance(meta.get("blocks"), dict):
        return [f"{path / 'meta.json'}: not a checkpoint's meta (no 'blocks' mapping)"]
    if meta.get("step") != step or isinstance(meta.get("step"), bool):
        return [
            f"{path / 'meta.json'}: the step inside is {meta.get('step')!r}, the folder's {step}"
        ]
    return []


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


def _refuse_old(path: Path) -> None:
    """Refuse a checkpoint of format 1: its ``state.pt`` is a pickle, never loaded."""
    if (path / "state.pt").exists():
        raise CheckpointError(
            f"Checkpointer.load: {path / 'state.pt'} is a checkpoint of an older rlblocks (format "
            "1: a pickle, which could run code when loaded, so it is never loaded); start the run "
            "again in a new folder, or finish it with the rlblocks version that wrote it"
        )


def _newest_file(folder: Path) -> Path | None:
    """The file written last under ``folder`` (where a write that failed stopped)."""
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    return max(files, key=lambda p: p.stat().st_mtime_ns, default=None)


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


__all__ = ["CheckpointError", "Checkpointer", "Restored", "Resume", "warn_if_config_differs"]
