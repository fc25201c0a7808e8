"""What a resumed run may change, and what a rerun of a run that never checkpointed does.

**A resumed run trains with what it is given, never silently with what was saved.** Every
setting is either honoured from the first resumed step on, or refused before it, by name:

- honoured: the trainers' `rlblocks.trainer.TrainConfig` (``lr``, ``schedule``, ``betas``,
  ``eps``, ``weight_decay``: the trainers put them back on the restored optimizer and schedule;
  the rest is read at every step), the recipe's hyperparameters (``group_size``, ``sampling``,
  the loss and its keywords, PPO's fixed ``kl_coef``, ...), `RunOptions` (``staleness`` 0 to 1,
  ``old_logprobs``), and ``steps`` growing. `check_resumed` lists what changed in one warning,
  "in effect from step k", and the checkpoints and the tracker's ``config.json`` then record
  the new configuration;
- refused here (`ResumeRefused`, before the first step): another ``recipe`` on the folder, and
  ``steps`` below the steps already done;
- refused by the blocks, when they load: the data's order (`rlblocks.data.PromptBatches`:
  seed, batch size, number of rows), the reference, the model and its LoRA layers, a batch
  sampled ahead resumed at staleness 0. The state that is genuinely state goes on: AdamW's
  moments, the schedule's step count, an adaptive KL controller's β, the data position.

**A run that never checkpointed a step can be run again** in its folder (`start_over`): it
left at most the checkpoint of step 0 (the initial weights), which the new run writes afresh,
and records of steps it did not checkpoint, which the tracker drops as a resume from step 0
would. ``resume=True`` there is refused: there is nothing to resume.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlblocks.checkpoint import Checkpointer
from rlblocks.checkpoint.folders import MARKER, step_folder, sweep


class ResumeRefused(ValueError):
    """A resumed run asked for a setting that cannot be honoured; the message names it."""


def check_resumed(
    saved: Mapping[str, Any], now: Mapping[str, Any], *, done: int, steps: int, where: Path
) -> None:
    """Refuse what a run resumed from the checkpoint of step ``done`` in ``where`` cannot
    honour (module docstring), then warn once with every setting that changed and is now in
    effect. ``saved``/``now``: the run configuration saved with the checkpoint, and this
    run's."""
    recipe, asked = saved.get("recipe"), now.get("recipe")
    if None not in (recipe, asked) and recipe != asked:  # a bare Run's config may name none
        raise ResumeRefused(
            f"RunOptions.resume: the checkpoint of step {done} in {where} is of a {recipe!r} "
            f"run, this run is {asked!r}; resume it with {recipe!r}, or run {asked!r} in "
            "another folder"
        )
    if steps < done:
        raise ResumeRefused(
            f"RunOptions.resume: the checkpoint in {where} was taken after {done} steps, and "
            f"steps={steps} asks for fewer; pass steps >= {done} (more extends the run), or "
            "start a new run in another folder"
        )
    changed = changed_settings(saved, now)
    changed.pop("steps", None)  # extending a run is normal
    if changed:
        what = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items())
        warnings.warn(
            f"RunOptions.resume: resuming {where} after step {done} with changed settings, in "
            f"effect from step {done} on: {what}",
            UserWarning,
            stacklevel=5,
        )


def changed_settings(
    saved: Mapping[str, Any], now: Mapping[str, Any], prefix: str = ""
) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, new value)}`` for every leaf that differs; nested mappings
    (``policy_config``, a schedule's fields) are compared key by key."""
    changed: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(saved) | set(now), key=str):
        old, new = saved.get(key), now.get(key)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            changed |= changed_settings(old, new, f"{prefix}{key}.")
        elif old != new:
            changed[f"{prefix}{key}"] = (old, new)
    return changed


def start_over(saver: Checkpointer) -> bool:
    """Make ``saver``'s folder ready for a run that starts at step 0 there; True when a run
    had used the folder before (its lock file was there) without checkpointing a step: that
    run's tracked records are then to be dropped. Removes what that run left: interrupted
    writes, and the checkpoint of step 0 (the initial weights, written again by the new run).
    Call it holding ``saver.lock``, after ``saver.resume_step`` said to start from the
    beginning (so no checkpoint of a later step is there)."""
    sweep(saver.root)
    if saver.latest() == 0:
        initial = step_folder(saver.root, 0)
        (initial / MARKER).unlink()  # first: a kill half-way leaves no "complete" remnant
        shutil.rmtree(initial)
    return bool(saver.lock.existed)


__all__ = ["ResumeRefused", "changed_settings", "check_resumed", "start_over"]
