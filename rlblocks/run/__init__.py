"""The run floor: the machinery under a training loop, between the recipes and the blocks.

- `Run` (`rlblocks.run.loop`): the caller's ``for`` loop drives it; it gives the loop the
  folder lock, resume, checkpoints, the tracker, the progress bar, the watchdog, the step's
  clock (``run.phase``) and the metrics every step reports (``run.record``);
- `RolloutSource`: the one place that decides where each step's rollouts and π_old come
  from (sampled in the step, or k steps ahead), and when the new weights reach the engine;
  `Batches` is the source of a plain stream of batches (SFT);
- `RunOptions`: a recipe's ``run=``, the loop's options and the source's in one object;
- `Clock` and the shared metrics (`rlblocks.run.clock`);
- `Drawn` and `run_config`: the run's state besides its blocks (`rlblocks.run.state`);
- what a resumed run may change (honoured, or refused with `ResumeRefused`), and how a run
  that never checkpointed a step is run again (`rlblocks.run.resume`);
- `Watchdog`: deadlines per phase, and a report of every thread's stack when one passes.

Blocks never import this package, and it imports no recipe; checkpoints
(`rlblocks.checkpoint`) and trackers (`rlblocks.tracking`) sit beside it. docs/run.md.
"""

from rlblocks.run.batches import Batches
from rlblocks.run.clock import KL_LOSS_METRICS, PHASES, Clock
from rlblocks.run.loop import Run, Source
from rlblocks.run.options import RunOptions, StepCallback, Tracker
from rlblocks.run.resume import ResumeRefused
from rlblocks.run.source import RolloutSource, samples_with_policy
from rlblocks.run.state import Drawn, describe, run_config
from rlblocks.run.watchdog import STALL_EXIT, Watchdog, thread_stacks

__all__ = [
    "KL_LOSS_METRICS",
    "PHASES",
    "STALL_EXIT",
    "Batches",
    "Clock",
    "Drawn",
    "ResumeRefused",
    "RolloutSource",
    "Run",
    "RunOptions",
    "Source",
    "StepCallback",
    "Tracker",
    "Watchdog",
    "describe",
    "run_config",
    "samples_with_policy",
    "thread_stacks",
]
