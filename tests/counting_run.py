"""A run of the run floor without a model, for the tests of folders, locks and resume: each
step adds the next batch (a number) to a `Stateful` counter, in a loop driven by
`rlblocks.run.Run` with its checkpoints and tracker. Imported by the tests, and run as a script in its own process
(the holder of a folder)::

    python counting_run.py FOLDER STEPS [--wait-after STEP] [--fail-at STEP] [--every N]

checkpoints into FOLDER/checkpoints and tracks into FOLDER, prints ``STEP i`` after each step;
``--wait-after k`` prints ``WAITING`` after step k and waits until FOLDER/go exists (a run in
progress, holding its folder); ``--fail-at k`` raises in step k.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from builders import Counter

import rlblocks as rb
from rlblocks.run import Batches, Run


def count(
    folder: Path,
    *,
    steps: int,
    resume: Any = "auto",
    every: int = 1,
    fail_at: int | None = None,
    tracker: bool = True,
    config: dict | None = None,
    on_step: Any = None,
) -> list[float]:
    """The run (module docstring); returns the counter after each step, resumed ones included."""
    counter, source = Counter(), Batches([1] * 100)

    with rb.tracking.Tracker(folder) if tracker else nullcontext() as track:
        run = Run(
            "count",
            steps=steps,
            blocks={"c": counter},
            config=config,
            checkpoint=rb.checkpoint.Checkpointer(folder / "checkpoints", every=every),
            resume=resume,
            tracker=track,
            on_step=on_step,
            progress=False,
        )
        with run.driving(source):
            for step in run:
                if step == fail_at:
                    raise RuntimeError(f"step {step} fails")
                counter.n += source.draw()
                run.record({"n": float(counter.n)})
    return [h["n"] for h in run.history]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder", type=Path)
    p.add_argument("steps", type=int)
    p.add_argument("--wait-after", type=int)
    p.add_argument("--fail-at", type=int)
    p.add_argument("--every", type=int, default=1)
    args = p.parse_args()

    def on_step(index: int, metrics: dict, rollouts: Any) -> None:
        print(f"STEP {index}", flush=True)
        if index == args.wait_after:
            print("WAITING", flush=True)
            while not (args.folder / "go").exists():
                time.sleep(0.05)

    count(args.folder, steps=args.steps, every=args.every, fail_at=args.fail_at, on_step=on_step)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
