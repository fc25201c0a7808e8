"""``Ray(...)``: blocks built in Ray worker processes, behind handles with the same methods.

    placement = rb.placement.Ray(workers=2)          # was: rb.placement.Local()
    policy = placement.build("actor", rb.trainer.PolicyTrainer.from_pretrained, "tiny", lr=1e-5)
    engine = placement.build("rollout", rb.rollout.HFEngine.from_pretrained, "tiny")

The module reads one way: this file (what the user configures) builds pools
(:mod:`rlblocks.placement.pool`: actors, placement groups, failures), hands out handles
(:mod:`rlblocks.placement.handle`: how a call is split) whose calls run in worker actors
(:mod:`rlblocks.placement.worker`). None of them knows a block class: what they rely on is in
``rlblocks.interfaces``.

**Pools and roles.** A :class:`Pool` is a set of worker processes that form one
``torch.distributed`` process group. Roles (actor, rollout, ref, critic, reward, teacher) map to pools;
roles on the same pool live in the same processes: that is the colocated "hybrid engine" of
verl, where the policy's FSDP shards and a rollout engine share each worker. A split layout
gives the rollout role its own pool; the resharder's copy then goes through Ray's object store.
A block that shards itself (``Shardable``: the trainers, FSDP2 as their ``config.fsdp`` says)
does so right after it is built.

**Handles.** ``build`` returns a :class:`WorkerGroup` whose methods are the block's, each call
split over the workers as the method declares (``rlblocks.interfaces.Dispatch``): a trainer's
``step`` goes whole to every worker (the trainer takes its share), ``logprobs`` and a reward's
``__call__`` by rows, ``generate`` by prompts. Plain attributes are read from rank 0.

**Failures.** An exception in a worker comes back as :class:`WorkerError` with the role, rank,
node and the worker's traceback, as soon as the first rank fails. If the other ranks do not
finish within a few seconds (they wait in a collective for the dead one), the whole pool is
stopped and :class:`PoolBroken` tells you to build again; a killed worker (OOM, ``kill -9``)
surfaces as :class:`WorkerDied` the same way. ``shutdown()`` (or ``with Ray(...) as p:``) kills
the workers, frees the placement groups and stops the Ray instance this object started, for
good: a later call on a handle raises :class:`PoolBroken` and ``build`` raises, at once and
without starting Ray again. A pool that finds no room fails within seconds, naming a placement
of this process that still holds it (:mod:`rlblocks.placement.capacity`).

**Listeners.** A local placement (no ``address``) starts Ray on 127.0.0.1 without the
dashboard, and its one-node pools meet over loopback (:mod:`rlblocks.placement.pool`): nothing
it opens listens on another interface.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from rlblocks.placement.handle import WorkerGroup
from rlblocks.placement.local import ROLES
from rlblocks.placement.pool import Pool, Workers
from rlblocks.placement.worker import LOOPBACK

__all__ = ["LOOPBACK", "Pool", "Ray", "WorkerGroup"]


@dataclass
class Ray:
    """A Ray cluster placement (see the module docstring).

    ``address``: a running cluster (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``); None
    (or ``"local"``) uses the Ray instance already initialized in this process or starts a
    local one, which listens on 127.0.0.1 only.
    ``workers``: shorthand for one pool of that many workers on one node holding every role.
    ``pools`` / ``roles``: named pools and which pool each role uses (roles left out use the
    first pool). ``collective_timeout``: seconds any collective may wait for a peer. ``env``:
    extra environment variables for the workers. ``init``: further ``ray.init`` keywords. How a
    trainer shards is the trainer's own setting (``TrainConfig.fsdp``).
    """

    address: str | None = None
    workers: int | None = None
    pools: Mapping[str, Pool] | None = None
    roles: Mapping[str, str] = field(default_factory=dict)
    collective_timeout: float = 600.0
    env: Mapping[str, str] = field(default_factory=dict)
    init: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pools is None:
            self.pools = {"default": Pool(workers_per_node=self.workers or 1)}
        elif self.workers is not None:
            raise ValueError("Ray: both workers=... and pools=... were given; give one of them")
        if not self.pools:
            raise ValueError("Ray: pools is empty; give at least one Pool")
        for role, pool in self.roles.items():
            if role not in ROLES:
                raise ValueError(f"Ray: unknown role {role!r}; use one of {', '.join(ROLES)}")
            if pool not in self.pools:
                raise ValueError(
                    f"Ray: role {role!r} maps to unknown pool {pool!r}; map it to one of {list(self.pools)}"
                )
        self._groups: dict[str, Workers] = {}
        self._started_ray = False
        self._shut_down = False

    # ------------------------------------------------------------------ Placement protocol
    def build(self, role: str, factory: Callable[..., Any], /, *args: Any, **kwargs: Any):
        """Build ``factory(*args, **kwargs)`` in every worker of ``role``'s pool; a handle back.

        ``factory`` and its arguments are pickled (cloudpickle: functions and lambdas defined in
        a notebook travel by value). Building a role again replaces its block.
        """
        if role not in ROLES:
            raise ValueError(f"Ray.build: unknown role {role!r}; use one of {', '.join(ROLES)}")
        if self._shut_down:  # starting Ray again here would be a surprise, and a new instance
            raise RuntimeError(
                f"Ray.build: this placement was shut down (placement.shutdown()), so it builds "
                f"no {role!r} block; create a new rb.placement.Ray(...) to start workers again"
            )
        workers = self._pool(self.pool_of(role))
        kinds = workers.submit(
            lambda actor, _: actor.build.remote(role, factory, args, kwargs),
            role=role,
            call=f"build({getattr(factory, '__qualname__', factory)!r})",
        )
        return WorkerGroup(workers, role, kinds[0])

    def pool_of(self, role: str) -> str:
        """The name of the pool ``role`` runs on (the first pool unless ``roles`` says)."""
        assert self.pools is not None  # __post_init__ sets it
        return self.roles.get(role, next(iter(self.pools)))

    @property
    def round_trips(self) -> int:
        """Remote calls made so far by the pools now running (each one task on every worker
        of a pool; building and starting count too)."""
        return sum(group.round_trips for group in self._groups.values())

    def shutdown(self) -> None:
        """Kill every worker, free the placement groups, stop the Ray instance started here.

        For good: every later call on a handle raises `PoolBroken` and ``build`` raises, both at
        once and without starting Ray again (a new local instance would be a surprise)."""
        for group in self._groups.values():
            group.stop("placement.shutdown() was called", final=True)
        self._groups.clear()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False
        self._shut_down = True

    def __enter__(self) -> Ray:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        assert self.pools is not None  # __post_init__ sets it
        pools = ", ".join(f"{k}={v.nodes}x{v.workers_per_node}" for k, v in self.pools.items())
        where = self.address or "local"
        return f"Ray({where}, pools: {pools}, roles: {dict(self.roles) or 'all on the first'})"

    # ------------------------------------------------------------------ pools
    def _pool(self, name: str) -> Workers:
        group = self._groups.get(name)
        if group is not None and group.broken is None:
            return group
        if group is not None:
            group.stop()
        self._connect()
        assert self.pools is not None  # __post_init__ sets it
        group = Workers(
            name,
            self.pools[name],
            env=self.env,
            collective_timeout=self.collective_timeout,
            owner=repr(self),
        )
        self._groups[name] = group
        return group

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        # A new instance, even if `ray start` runs on this machine ("local" is Ray's own word
        # for that, not a cluster's address: it listens on loopback too).
        if self.address in (None, "local"):
            kwargs["address"] = "local"
            assert self.pools is not None  # __post_init__ sets it
            needed = sum(p.size * p.cpus_per_worker for p in self.pools.values())
            kwargs["num_cpus"] = max(int(-(-needed // 1)), os.cpu_count() or 1)
            kwargs |= {"_node_ip_address": LOOPBACK, "dashboard_host": LOOPBACK}
        else:
            kwargs["address"] = self.address
        kwargs.update(self.init)
        with _loopback_allowed(kwargs.get("_node_ip_address") == LOOPBACK):
            ray.init(**kwargs)
        self._started_ray = True


@contextlib.contextmanager
def _loopback_allowed(allowed: bool) -> Iterator[None]:
    """Let a local Ray instance take 127.0.0.1 as its node address, so that its servers (GCS,
    raylet, object manager, workers) listen on the loopback interface only.

    On Linux Ray turns a node address of 127.0.0.1 into the machine's routable one, and then
    listens on every interface; it keeps the loopback address only where multi-node clusters
    are off (``ray_constants.ENABLE_RAY_CLUSTER``, its default on macOS and Windows). That flag
    is read when a node starts, so it is switched off only around this ``ray.init``.
    """
    if not allowed:
        yield
        return
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
