"""The run floor: how a recipe's run is driven, between the recipes and the blocks.

- `RunOptions` (``run=`` of every recipe): progress, ``on_step``, checkpoint and resume, the
  tracker, and where rollouts and π_old come from (``staleness``, ``old_logprobs``);
- `RolloutSource`: the one place that decides where each step's rollouts and π_old come from
  (sampled in the step, or one step ahead) and when the new weights reach the engine;
- `run_steps` and `Clock`: the loop every recipe shares (`rlblocks.run.loop`);
- `Drawn` and `run_config`: the run's state besides its blocks (`rlblocks.run.state`);
- what a resumed run may change (honoured, or refused with `ResumeRefused`), and how a run
  that never checkpointed a step is run again (`rlblocks.run.resume`).

Blocks never import this package, and it imports no recipe; checkpoints
(`rlblocks.checkpoint`) and trackers (`rlblocks.tracking`) sit beside it. docs/run.md.
"""

from rlblocks.run.loop import KL_LOSS_METRICS, PHASES, Clock, OutOfData, Source, Step, run_steps
from rlblocks.run.options import RunOptions, StepCallback, Tracker, recipe
from rlblocks.run.resume import ResumeRefused
from rlblocks.run.source import Batches, RolloutSource, samples_with_policy
from rlblocks.run.state import Drawn, describe, run_config
from rlblocks.run.watchdog import STALL_EXIT, Watchdog, thread_stacks

__all__ = [
    "KL_LOSS_METRICS",
    "PHASES",
    "STALL_EXIT",
    "Batches",
    "Clock",
    "Drawn",
    "OutOfData",
    "ResumeRefused",
    "RolloutSource",
    "RunOptions",
    "Source",
    "Step",
    "StepCallback",
    "Tracker",
    "Watchdog",
    "describe",
    "recipe",
    "run_config",
    "run_steps",
    "samples_with_policy",
    "thread_stacks",
]
