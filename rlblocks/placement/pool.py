"""The workers of one pool, seen from the driver: start, one round trip to all, fail fast, stop.

A :class:`Pool` is a set of worker processes, ``nodes`` × ``workers_per_node``, each with its
CPUs/GPUs, held in place by one Ray placement group (one bundle per node, ``STRICT_SPREAD``
over nodes, so the pool really spans ``nodes`` machines), reserved by
:func:`rlblocks.placement.capacity.reserve` (which fails within seconds when there is no
room). Its workers form one ``torch.distributed`` process group (gloo on CPUs, NCCL on GPUs)
with a timeout on every collective. :class:`Workers` is the driver's record of a started pool; every remote call goes
through :meth:`Workers.submit`, one task per worker, which counts it (``round_trips``).

**The network.** A pool on one node (``nodes=1``) meets over the loopback interface: rank 0's
rendezvous store listens on 127.0.0.1, and gloo and NCCL are pointed at the loopback interface
(``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, unless the pool's ``env`` names another), so
nothing the pool opens is reachable from another machine. A pool that spans nodes listens on
every interface: its ranks must reach rank 0 across the network.

**After the end.** `Workers.check` runs before every call and touches no Ray API that could
start Ray: a pool stopped by ``placement.shutdown()``, or whose Ray instance is gone, refuses
at once with `PoolBroken`.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlblocks.placement.capacity import hold, reserve, session
from rlblocks.placement.errors import PoolBroken, WorkerDied, WorkerError
from rlblocks.placement.worker import LOOPBACK, Worker

# Environment the workers inherit from the driver (offline hub, caches, thread counts).
FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "RLBLOCKS_CACHE", "HF_HOME")
GRACE_SECONDS = 5.0  # after a rank fails, how long the others get to finish before the stop


@dataclass(frozen=True)
class Pool:
    """A set of worker processes: ``nodes`` machines × ``workers_per_node`` workers each.

    ``gpus_per_worker`` 0 hides the node's GPUs from the workers (``CUDA_VISIBLE_DEVICES=""``),
    so that a block loaded there with the default device lands on the CPU.
    """

    nodes: int = 1
    workers_per_node: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ValueError(
                f"Pool: nodes and workers_per_node must be >= 1, got {self}; pass positive counts"
            )
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise ValueError(
                f"Pool: negative resources in {self}; pass cpus and gpus per worker >= 0"
            )

    @property
    def size(self) -> int:
        """Workers in the pool: ``nodes × workers_per_node``."""
        return self.nodes * self.workers_per_node


class Workers:
    """Driver-side record of one started pool: its actors, placement group and health."""

    def __init__(
        self,
        name: str,
        pool: Pool,
        *,
        env: Mapping[str, str],
        collective_timeout: float,
        owner: str = "a placement",
    ) -> None:
        self.name, self.pool, self.owner = name, pool, owner
        self.broken: str | None = None
        self.final = False  # stopped for good: placement.shutdown(), or Ray is gone
        self.round_trips = 0  # remote calls made, each one task on every worker
        self.actors: list[Any] = []
        self.info: list[dict[str, Any]] = []
        self.bundle = {"CPU": pool.cpus_per_worker * pool.workers_per_node}
        if pool.gpus_per_worker:
            self.bundle["GPU"] = pool.gpus_per_worker * pool.workers_per_node
        self.nodes = pool.nodes
        self.session = session()
        self.pg = reserve(name, self.bundle, pool.nodes)  # fails within seconds
        hold(self)
        # Forgotten (no placement, no handle left): its actors die with their handles, and
        # this gives the placement group's resources back too.
        finalizer = weakref.finalize(self, _remove_quietly, self.pg)
        finalizer.atexit = False
        try:
            self._start(env, collective_timeout)
        except BaseException:
            self.stop(reason="it failed to start")  # no actor or placement group left behind
            raise

    def _start(self, env: Mapping[str, str], collective_timeout: float) -> None:
        pool = self.pool
        threads = max(1, int(pool.cpus_per_worker))
        forwarded = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        # Ray leaves CUDA_VISIBLE_DEVICES alone in a worker given no GPU: it would see every GPU
        # of its node, and the default device (CUDA when torch sees a GPU) would put all such
        # workers on GPU 0, outside Ray's accounting. A pool without GPUs is shown none.
        hidden = {} if pool.gpus_per_worker else {"CUDA_VISIBLE_DEVICES": ""}
        env = {**forwarded, **hidden, "OMP_NUM_THREADS": str(threads), **env}
        actor = ray.remote(Worker)
        for rank in range(pool.size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=rank // pool.workers_per_node
            )
            self.actors.append(
                actor.options(
                    num_cpus=pool.cpus_per_worker,
                    num_gpus=pool.gpus_per_worker,
                    scheduling_strategy=strategy,
                    runtime_env={"env_vars": env},
                ).remote(self.name, rank, pool.size, threads)
            )
        role = f"pool {self.name}"
        # A pool on one node meets over the loopback interface: nothing it opens is reachable
        # from the network. Only a pool spanning nodes needs rank 0's store on every interface.
        loopback = pool.nodes == 1
        host = LOOPBACK if loopback else None
        self.info = self.submit(lambda a, _: a.info.remote(host), role=role, call="start")
        backend = "nccl" if pool.gpus_per_worker else "gloo"
        address = (host or self.info[0]["ip"], self.info[0]["port"])
        self.submit(
            lambda a, _: a.init_process_group.remote(
                address, backend, collective_timeout, loopback=loopback
            ),
            role=role,
            call="init_process_group",
        )

    @property
    def size(self) -> int:
        """The number of started worker actors."""
        return len(self.actors)

    def submit(self, task: Callable[[Any, int], Any], *, role: str, call: str) -> list:
        """One round trip: ``task(actor, rank)`` submits a Ray task to each worker; the answers
        come back in rank order, or the first failure is raised (:meth:`wait`)."""
        self.check()
        self.round_trips += 1
        futures = [task(actor, rank) for rank, actor in enumerate(self.actors)]
        return self.wait(futures, role=role, call=call)

    def calls(
        self,
        role: str,
        per_rank: Sequence[tuple[str, Any, Any]],
        call: str,
        *,
        every: bool = False,
    ) -> list:
        """``block.method(*args, **kwargs)`` on each rank's ``role`` block (one ``(method, args,
        kwargs)`` per rank); only rank 0 sends its answer back unless ``every``."""

        def task(actor: Any, rank: int) -> Any:
            method, args, kwargs = per_rank[rank]
            return actor.call.remote(role, method, args, kwargs, every or rank == 0)

        return self.submit(task, role=role, call=call)

    def wait(self, futures: list, *, role: str, call: str) -> list:
        """Results of ``futures`` (one per rank), failing fast on the first error.

        After a first failure the other ranks get ``GRACE_SECONDS`` to finish: a rank waiting in
        a collective for a dead peer errors out or stays stuck. A rank that died is reported in
        preference to the errors it caused elsewhere; if a rank died or some are still running,
        the pool is stopped so that nothing hangs.
        """
        rank_of = {f: r for r, f in enumerate(futures)}
        results: dict[int, Any] = {}
        failures: list[WorkerError] = []
        pending = list(futures)
        while pending and not failures:
            ready, pending = ray.wait(pending, num_returns=1)
            self._collect(ready, rank_of, results, failures, role, call)
        if not failures:
            return [results[r] for r in range(len(futures))]
        still: list = []
        if pending:
            done, still = ray.wait(pending, num_returns=len(pending), timeout=GRACE_SECONDS)
            self._collect(done, rank_of, results, failures, role, call)
        died = [e for e in failures if isinstance(e, WorkerDied)]
        error = died[0] if died else failures[0]
        if died or still:
            how = "died" if died else "failed"
            self.stop(reason=f"{error.role} rank {error.rank} {how} in {error.call}")
        raise error

    def _collect(self, ready, rank_of, results, failures, role: str, call: str) -> None:
        for future in ready:
            rank = rank_of[future]
            try:
                results[rank] = ray.get(future)
            except ray.exceptions.RayActorError as e:
                failures.append(WorkerDied(role, rank, self._node(rank), call, _first_line(e)))
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, WorkerError) else None
                failures.append(
                    cause or WorkerError(role, rank, self._node(rank), call, str(e), "")
                )

    def _node(self, rank: int) -> str:
        return self.info[rank]["node"][:8] if self.info else "?"

    def check(self) -> None:
        """Raise `PoolBroken` if the pool cannot take a call, before any Ray API is touched
        (``ray.put`` or ``ray.get`` without a running Ray would start a new local instance).

        A pool stopped after a failure can be built again; one stopped by
        ``placement.shutdown()``, or whose Ray instance is gone (``ray.shutdown()``, a new
        ``ray.init``), needs a new placement.
        """
        if self.broken is None and (not ray.is_initialized() or session() != self.session):
            self.broken, self.final = "the Ray instance it ran on is gone", True
        if self.broken is None:
            return
        if self.final:
            raise PoolBroken(
                f"Ray: pool {self.name!r} takes no more calls: {self.broken}; create a new "
                "rb.placement.Ray(...) and build its blocks there"
            )
        raise PoolBroken(
            f"Ray: the workers of pool {self.name!r} were stopped: {self.broken}; build its "
            "blocks again with placement.build(...)"
        )

    def stop(self, reason: str = "shut down", *, final: bool = False) -> None:
        """Kill every worker actor and release the placement group; later calls fail with
        ``reason`` (``final``: and tell the user to make a new placement, `check`)."""
        if self.broken is None:
            self.broken, self.final = reason, final
        for actor in self.actors:
            with contextlib.suppress(ValueError, ray.exceptions.RayError):  # already gone
                ray.kill(actor, no_restart=True)
        _remove_quietly(self.pg)


def _remove_quietly(pg: Any) -> None:
    if not ray.is_initialized():  # Ray stopped: the group is gone (and Ray's calls would
        return  # start a new instance)
    with contextlib.suppress(ValueError, ray.exceptions.RayError):  # already gone
        remove_placement_group(pg)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
