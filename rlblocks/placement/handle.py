"""``WorkerGroup``: the handle ``Ray.build`` returns, with the block's methods.

A method call on the handle is one round trip to every worker of the pool, split as the method
declares (``rlblocks.interfaces.Dispatch``):

- ``ALL``: every worker gets the same arguments (put in Ray's object store once); the first
  worker's answer comes back. ``PolicyTrainer.step`` is one: the trainer splits the batch over
  its ranks itself and answers for the whole group.
- ``ROWS``: the rows of the ``Rollouts`` argument (and of every ``(b …)`` tensor argument) go to
  the workers balanced by tokens, every worker getting at least one row (FSDP's collectives need
  every rank: a worker without a row of its own scores a copy of row 0, thrown away); answers
  come back in row order. A block whose forward spans several ranks (``row_replicas`` of a
  tensor-parallel trainer, ``rlblocks.interfaces.Shardable``) gets the same rows on each group
  of that many consecutive ranks, and one answer per group. Undeclared methods that take a ``Rollouts`` (a reward function's
  ``__call__``) are split this way.
- ``PROMPTS``: prompts and their ``metadata`` in contiguous pieces; the ``Rollouts`` come back
  concatenated in prompt order, group ids renumbered; with a seed, worker r samples with
  ``seed + r``.

Anything else a block has is read from the first worker (``policy.config``): a round trip, for
a notebook, not for a training loop. :meth:`WorkerGroup.run_with` carries a function to where
the block lives (``rlblocks.interfaces.Handle``): the resharder's copy runs there. The handle
knows no block class, no metric and no loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from rlblocks.base.stacks import SignalStacks
from rlblocks.interfaces import Dispatch
from rlblocks.placement.pool import Workers
from rlblocks.placement.scatter import (
    contiguous_partition,
    gather_answers,
    rank_seed,
    take_rows,
)
from rlblocks.placement.worker import GETATTR, NOOP, Call
from rlblocks.rollouts import Rollouts


class WorkerGroup:
    """The handle ``Ray.build`` returns: the block's methods, run across the pool's workers."""

    def __init__(self, workers: Workers, role: str, kind: Mapping[str, Any]) -> None:
        self._workers, self._role = workers, role
        self._type = kind["type"]
        self._methods: dict[str, Dispatch | None] = dict(kind["methods"])
        self._attributes = frozenset(kind["attributes"])  # at build time
        self._replicas = int(kind.get("replicas", 1))  # ranks that get the same rows

    @property
    def world_size(self) -> int:
        """The number of workers in the group."""
        return self._workers.size

    @property
    def role(self) -> str:
        """The role the block was built for (``"actor"``, ``"rollout"``, ...)."""
        return self._role

    def __repr__(self) -> str:
        return (
            f"WorkerGroup({self._type} as {self._role!r} on pool {self._workers.name!r}, "
            f"{self.world_size} workers)"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._methods:
            return _Method(self, name)
        if name not in self._attributes:  # as the block itself would answer
            raise AttributeError(f"{self._type} (as {self._role!r}) has no attribute {name!r}")
        rest: list[Call] = [(NOOP, (), {})] * (self.world_size - 1)  # only rank 0 answers
        return self._workers.calls(self._role, [(GETATTR, (name,), {}), *rest], name)[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Method(self, "__call__")(*args, **kwargs)

    # ------------------------------------------------------------------ Handle
    def run_with(self, fn: Callable[[Any, Any], Any], other: Any, /) -> list[Any]:
        """``fn(block, other's block)`` in every worker (``Handle``).

        ``other`` on this pool: each worker passes its own block of that role; every worker's
        answer comes back, by rank. Elsewhere (a handle on another pool, or a block in this
        process): each worker passes a stand-in (``rlblocks.placement.worker.Relay``); the
        calls rank 0's ``fn`` made on it are then made on ``other``, in order, in its pool's
        workers (one more round trip) or here, and only rank 0's answer comes back (the other
        workers' calls were dropped).
        """
        name = getattr(fn, "__name__", "run_with")
        if isinstance(other, WorkerGroup) and other._workers is self._workers:
            answers = self._workers.submit(
                lambda actor, _: actor.run_with.remote(self._role, fn, other._role, False),
                role=self._role,
                call=name,
            )
            return [answer for answer, _ in answers]
        answers = self._workers.submit(
            lambda actor, rank: actor.run_with.remote(self._role, fn, None, rank == 0),
            role=self._role,
            call=name,
        )
        recorded = answers[0][1]
        if isinstance(other, WorkerGroup):
            other._workers.submit(
                lambda actor, _: actor.replay.remote(other._role, recorded),
                role=other._role,
                call=name,
            )
        else:
            for method, ref in recorded:
                args, kwargs = ray.get(ref)
                getattr(other, method)(*args, **kwargs)
        return [answers[0][0]]

    # ------------------------------------------------------------------ worker information
    def pids(self) -> list[int]:
        """Process ids of the workers, by rank (for debuggers and tests)."""
        return [info["pid"] for info in self._workers.info]

    def nodes(self) -> list[str]:
        """Ray node id of each rank's worker."""
        return [info["node"] for info in self._workers.info]

    def stacks(self) -> str:
        """Every thread's Python stack in each rank's worker on the driver's node, read while
        the worker runs whatever it runs (`rlblocks.base.stacks`: the worker answers a signal from
        C, even blocked in a collective); a rank on another node is named as out of reach.
        What a stall report (`rlblocks.run.watchdog.Watchdog`) asks of its workers."""
        here = ray.get_runtime_context().get_node_id()
        parts = []
        for rank, info in enumerate(self._workers.info):
            head = f"{self._role} rank {rank} (pid {info['pid']}, node {info['node'][:8]})"
            if info["node"] != here or not info.get("stacks"):
                parts.append(f"{head}: on another node, out of reach here (run `ray stack` there)")
            else:
                parts.append(f"{head}:\n{SignalStacks(info['pid'], info['stacks']).stacks()}")
        return "\n".join(parts)


class _Method:
    """A block method called through a worker group, split as it declares (module docstring)."""

    def __init__(self, group: WorkerGroup, name: str) -> None:
        self.group, self.name = group, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.group._workers.check()  # before ray.put, which would start a Ray that is gone
        mode = self.group._methods.get(self.name)
        batch = next((a for a in (*args, *kwargs.values()) if isinstance(a, Rollouts)), None)
        if mode is None:
            mode = Dispatch.ROWS if batch is not None else Dispatch.ALL
        if mode is Dispatch.PROMPTS:
            return self._prompts(*args, **kwargs)
        if mode is Dispatch.ROWS and batch is not None and self.group.world_size > 1:
            return self._rows(batch, args, kwargs)
        return self._all(args, kwargs)

    def _all(self, args: tuple, kwargs: dict) -> Any:
        g = self.group
        call = (self.name, ray.put(args), ray.put(kwargs))  # sent once, read by every worker
        return g._workers.calls(g._role, [call] * g.world_size, self.name)[0]

    def _rows(self, batch: Rollouts, args: tuple, kwargs: dict) -> Any:
        g, b = self.group, len(batch)
        replicas = g._replicas  # consecutive ranks that compute one forward together (TP)
        index = batch.balanced_shares(g.world_size // replicas)
        weights = [len(rows) for rows in index]
        index = [rows or [0] for rows in index]  # every rank runs (FSDP collectives)
        calls = [
            (
                self.name,
                tuple(take_rows(a, rows, b) for a in args),
                {k: take_rows(v, rows, b) for k, v in kwargs.items()},
            )
            for rows in index
            for _ in range(replicas)
        ]
        answers = g._workers.calls(g._role, calls, self.name, every=True)[::replicas]
        return gather_answers(answers, index, b, weights)

    def _prompts(self, prompts: Sequence[Any], *args: Any, **kwargs: Any) -> Rollouts:
        g = self.group
        metadata = kwargs.get("metadata")
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(
                f"{self.name}: {len(metadata)} metadata entries for {len(prompts)} prompts; "
                "pass one entry per prompt"
            )
        pieces = contiguous_partition(len(prompts), g.world_size)
        calls: list[Call] = []
        for rank, rows in enumerate(pieces):
            if not rows:
                calls.append((NOOP, (), {}))
                continue
            local = dict(kwargs)
            if metadata is not None:
                local["metadata"] = [metadata[i] for i in rows]
            if "sampling" in local:
                local["sampling"] = rank_seed(local["sampling"], rank)
            calls.append((self.name, ([prompts[i] for i in rows], *args), local))
        answers = g._workers.calls(g._role, calls, self.name, every=True)
        parts = [  # renumber groups: prompt i of the whole call is group i
            answer.replace(group_ids=answer.group_ids + rows[0])
            for answer, rows in zip(answers, pieces, strict=True)
            if rows
        ]
        return parts[0] if len(parts) == 1 else Rollouts.concat(parts)
