"""Whole-run checkpoints: `Checkpointer` saves and restores every block of a run atomically.

    ckpt = rb.checkpoint.Checkpointer("runs/ppo/checkpoints", every=10, keep_last=2)
    rb.recipes.ppo(policy, critic, engine, reward, batches, steps=200,
                   run=rb.run.RunOptions(checkpoint=ckpt, resume="auto"))

See `rlblocks.checkpoint.checkpointer` for what a checkpoint holds, `rlblocks.checkpoint.folders`
for how it is written so that a kill or a full disk never leaves a half-written one selected,
`rlblocks.checkpoint.lock` for the lock that keeps one run per folder.
"""

from rlblocks.base.rng import rng_state, set_rng_state
from rlblocks.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointError,
    Restored,
    Resume,
    warn_if_config_differs,
)
from rlblocks.checkpoint.lock import FolderInUseError

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "FolderInUseError",
    "Restored",
    "Resume",
    "rng_state",
    "set_rng_state",
    "warn_if_config_differs",
]
