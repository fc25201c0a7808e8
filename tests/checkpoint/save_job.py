"""A save that may fail, in its own process, for tests/checkpoint/test_failed_saves.py:

    python save_job.py ROOT

Saves the checkpoint of step 0 of a tiny policy into ROOT (a Checkpointer), trains it one step
and saves step 1. The test runs it where the disk fills up or the file size is limited in the
middle of step 1's optimizer shard. Prints one JSON line: the `CheckpointError`'s message (None
if the save went through), the complete steps, every path left under ROOT and the files'
sizes. Anything else raised (DCP's ``CheckpointException`` is a ``BaseException``) escapes:
the process fails with its traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: builders

import torch
from builders import ragged_rollouts, tiny_trainer

import rlblocks as rb
from rlblocks.checkpoint import Checkpointer, CheckpointError


def main() -> None:
    root = Path(sys.argv[1])
    ckpt = Checkpointer(root, keep_last=None)
    policy = tiny_trainer()
    ckpt.save(0, {"policy": policy})
    policy.step(ragged_rollouts(8), torch.randn(8), loss_fn=rb.recipes.defaults.PPO_CLIP)
    try:
        ckpt.save(1, {"policy": policy})
        error = None
    except CheckpointError as err:
        error = str(err)
    files = sorted(p for p in root.rglob("*"))
    print(
        json.dumps(
            {
                "error": error,
                "steps": ckpt.steps(),
                "paths": [p.relative_to(root).as_posix() for p in files],
                "sizes": {
                    p.relative_to(root).as_posix(): p.stat().st_size for p in files if p.is_file()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
