"""Process isolation: run a function in a worker process that can really be stopped.

One part, used by `rlblocks.envs.ProcessRunner` (tool calls) and `rlblocks.rewards.ProcessPool`
(reward rows), which keep only what is theirs: what a message asks and how its answer reads.

- `rlblocks.isolation.process` (the caller's side): `WorkerProcess` starts a fresh interpreter
  in a session of its own, talks to it over a socket pair, and kills its whole process group;
  `kill_all` is the finalizer that stops a caller's workers.
- `rlblocks.isolation.worker` (the worker's side, standard library only): the loop that loads
  functions and answers messages through the caller's *handler* module, with the fork guard
  and the watchdog that kills the worker once the caller's process is gone.

Its modules import nothing of rlblocks: the worker runs without the package (whose
``__init__`` imports torch), and a block that isolates its work imports this one.
"""

from rlblocks.isolation.process import LOAD_LIMIT, WorkerProcess, kill_all, worker_command
from rlblocks.isolation.worker import describe

__all__ = ["LOAD_LIMIT", "WorkerProcess", "describe", "kill_all", "worker_command"]
