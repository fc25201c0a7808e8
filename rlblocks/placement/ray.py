"""``Ray(...)``: blocks built in Ray worker processes, behind handles with the same methods.

    placement = rb.placement.Ray(workers=2)          # was: rb.placement.Local()
    policy = placement.build("actor", rb.trainer.PolicyTrainer.from_pretrained, "tiny", lr=1e-5)
    engine = placement.build("rollout", rb.rollout.HFEngine.from_pretrained, "tiny")

**Pools and roles.** A :class:`Pool` is a set of worker processes: ``nodes`` × ``workers_per_node``,
each with its CPUs/GPUs, held in place by one Ray placement group (one bundle per node,
``STRICT_SPREAD`` over nodes, so the pool really spans ``nodes`` machines). The workers of a
pool form one ``torch.distributed`` process group (gloo on CPUs, NCCL on GPUs) with a timeout on
every collective. Roles (actor, rollout, ref, critic, reward) map to pools; roles on the same
pool live in the same processes: that is the colocated "hybrid engine" of verl, where the
policy's FSDP shards and a rollout engine share each worker. A split layout gives the rollout
role its own pool; the Resharder then moves weights through Ray's object store.

**Handles.** ``build`` returns a :class:`WorkerGroup`. Its methods are the block's methods:

- ``generate(prompts, n=...)``: prompts cut into contiguous pieces, one per worker; the
  ``Rollouts`` come back concatenated in prompt order, group ids renumbered.
- ``step(rollouts, advantages, loss_fn=...)`` of a ``PolicyTrainer``: the driver draws the
  mini-batches exactly as one process would, splits each across the ranks balanced by tokens
  (:mod:`rlblocks.placement.balance`), and each rank updates its FSDP shard on its share; the
  normalizer is summed over the ranks, so the result is the one-process result.
- any other method taking ``Rollouts`` (``logprobs``, ``ref_logprobs``, ``values``, a reward's
  ``__call__``): rows split balanced by tokens (every rank gets at least one row: FSDP's
  collectives need all of them), results put back in row order.
- anything else: called on every worker with the same arguments; rank 0's result comes back.
  Plain attributes (``policy.tokenizer``, ``policy.config``) are read from rank 0.

**Failures.** An exception in a worker comes back as :class:`WorkerError` with the role, rank,
node and the worker's traceback, as soon as the first rank fails. If the other ranks do not
finish within a few seconds (they wait in a collective for the dead one), the whole pool is
stopped and :class:`PoolBroken` tells you to build again; a killed worker (OOM, ``kill -9``)
surfaces as :class:`WorkerDied` the same way. ``shutdown()`` (or ``with Ray(...) as p:``) kills
the workers, frees the placement groups and stops the Ray instance this object started.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlblocks.placement.balance import balanced_partition, contiguous_partition, gather_rows
from rlblocks.placement.errors import PoolBroken, WorkerDied, WorkerError
from rlblocks.placement.local import ROLES
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.parallel import FSDP

# Environment the workers inherit from the driver (offline hub, caches, thread counts).
_FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "RLBLOCKS_CACHE", "HF_HOME")
GRACE_SECONDS = 5.0  # after a rank fails, how long the others get to finish before the stop


@dataclass(frozen=True)
class Pool:
    """A set of worker processes: ``nodes`` machines × ``workers_per_node`` workers each."""

    nodes: int = 1
    workers_per_node: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ValueError(f"Pool needs nodes >= 1 and workers_per_node >= 1, got {self}")
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise ValueError(f"Pool: negative resources in {self}")

    @property
    def size(self) -> int:
        return self.nodes * self.workers_per_node


@dataclass
class Ray:
    """A Ray cluster placement (see the module docstring).

    ``address``: a running cluster (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``); None
    uses the Ray instance already initialized in this process or starts a local one.
    ``workers``: shorthand for one pool of that many workers on one node holding every role.
    ``pools`` / ``roles``: named pools and which pool each role uses (roles left out use the
    first pool). ``fsdp``: how ``PolicyTrainer`` blocks are sharded. ``collective_timeout``:
    seconds any collective may wait for a peer. ``env``: extra environment variables for the
    workers. ``init``: further ``ray.init`` keywords.
    """

    address: str | None = None
    workers: int | None = None
    pools: Mapping[str, Pool] | None = None
    roles: Mapping[str, str] = field(default_factory=dict)
    fsdp: FSDP = field(default_factory=FSDP)
    collective_timeout: float = 600.0
    env: Mapping[str, str] = field(default_factory=dict)
    init: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pools is None:
            self.pools = {"default": Pool(workers_per_node=self.workers or 1)}
        elif self.workers is not None:
            raise ValueError("Ray: give workers=... or pools=..., not both")
        if not self.pools:
            raise ValueError("Ray: pools is empty")
        for role, pool in self.roles.items():
            if role not in ROLES:
                raise ValueError(f"Ray: unknown role {role!r}; roles are {', '.join(ROLES)}")
            if pool not in self.pools:
                raise ValueError(f"Ray: role {role!r} maps to unknown pool {pool!r}")
        self._groups: dict[str, _PoolWorkers] = {}
        self._started_ray = False

    # ------------------------------------------------------------------ Placement protocol
    def build(self, role: str, factory: Callable[..., Any], /, *args: Any, **kwargs: Any):
        """Build ``factory(*args, **kwargs)`` in every worker of ``role``'s pool; a handle back.

        ``factory`` and its arguments are pickled (cloudpickle: functions and lambdas defined in
        a notebook travel by value). Building a role again replaces its block.
        """
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        pool = self._pool(self.pool_of(role))
        return pool.build(role, factory, args, kwargs, self.fsdp)

    def pool_of(self, role: str) -> str:
        """The name of the pool ``role`` runs on (the first pool unless ``roles`` says)."""
        return self.roles.get(role, next(iter(self.pools)))

    def shutdown(self) -> None:
        """Kill every worker, free the placement groups, stop the Ray instance started here."""
        for group in self._groups.values():
            group.stop()
        self._groups.clear()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    def __enter__(self) -> Ray:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        pools = ", ".join(f"{k}={v.nodes}x{v.workers_per_node}" for k, v in self.pools.items())
        where = self.address or "local"
        return f"Ray({where}, pools: {pools}, roles: {dict(self.roles) or 'all on the first'})"

    # ------------------------------------------------------------------ pools
    def _pool(self, name: str) -> _PoolWorkers:
        group = self._groups.get(name)
        if group is not None and group.broken is None:
            return group
        if group is not None:
            group.stop()
        self._connect()
        group = _PoolWorkers(name, self.pools[name], self)
        self._groups[name] = group
        return group

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if self.address is None:  # a new instance, even if `ray start` runs on this machine
            kwargs["address"] = "local"
            needed = sum(p.size * p.cpus_per_worker for p in self.pools.values())
            kwargs["num_cpus"] = max(int(-(-needed // 1)), os.cpu_count() or 1)
        else:
            kwargs["address"] = self.address
        kwargs.update(self.init)
        ray.init(**kwargs)
        self._started_ray = True


# ---------------------------------------------------------------------- the workers of a pool
class _PoolWorkers:
    """Driver-side record of one pool: its actors, placement group and health."""

    def __init__(self, name: str, pool: Pool, placement: Ray) -> None:
        self.name, self.pool = name, pool
        self.broken: str | None = None
        bundle = {"CPU": pool.cpus_per_worker * pool.workers_per_node}
        if pool.gpus_per_worker:
            bundle["GPU"] = pool.gpus_per_worker * pool.workers_per_node
        strategy = "STRICT_SPREAD" if pool.nodes > 1 else "STRICT_PACK"
        self.pg = placement_group([dict(bundle) for _ in range(pool.nodes)], strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"Ray: pool {name!r} cannot be placed: it needs {pool.nodes} node(s) with "
                f"{bundle} free each; the cluster has {ray.available_resources()}"
            ) from None
        try:
            self._start(placement)
        except BaseException:
            self.stop(reason="it failed to start")  # no actor or placement group left behind
            raise

    def _start(self, placement: Ray) -> None:
        pool, name = self.pool, self.name
        env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
        threads = max(1, int(pool.cpus_per_worker))
        env |= {"OMP_NUM_THREADS": str(threads), **placement.env}
        actor = ray.remote(_Worker)
        self.actors = []
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
                    name=None,
                ).remote(name, rank, pool.size, threads)
            )
        self.info = self.wait(
            [a.info.remote() for a in self.actors], role=f"pool {name}", call="start"
        )
        backend = "nccl" if pool.gpus_per_worker else "gloo"
        master = self.info[0]
        init = f"tcp://{master['ip']}:{master['port']}"
        self.wait(
            [
                a.init_process_group.remote(init, backend, placement.collective_timeout)
                for a in self.actors
            ],
            role=f"pool {name}",
            call="init_process_group",
        )

    @property
    def size(self) -> int:
        return len(self.actors)

    def build(
        self, role: str, factory: Callable, args: tuple, kwargs: dict, fsdp: FSDP
    ) -> WorkerGroup:
        kinds = self.wait(
            [a.build.remote(role, factory, args, kwargs, fsdp) for a in self.actors],
            role=role,
            call=f"build({getattr(factory, '__qualname__', factory)!r})",
        )
        return WorkerGroup(self, role, kinds[0])

    def call(self, role: str, per_rank: Sequence[tuple[str, tuple, dict]], call: str) -> list:
        """Run ``(method, args, kwargs)`` on each rank's ``role`` block; results in rank order."""
        self.check()
        futures = [
            a.call.remote(role, method, args, kwargs)
            for a, (method, args, kwargs) in zip(self.actors, per_rank, strict=True)
        ]
        return self.wait(futures, role=role, call=call)

    def run(self, role: str, fn: Callable, per_rank_args: Sequence[tuple], call: str) -> list:
        """Run ``fn(worker, *args)`` in each worker (resharding, weight gathering)."""
        self.check()
        futures = [
            a.run.remote(role, fn, args) for a, args in zip(self.actors, per_rank_args, strict=True)
        ]
        return self.wait(futures, role=role, call=call)

    def check(self) -> None:
        if self.broken is not None:
            raise PoolBroken(
                f"the workers of pool {self.name!r} were stopped: {self.broken}. Build its "
                "blocks again with placement.build(...)"
            )

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
        info = getattr(self, "info", None)
        return info[rank]["node"][:8] if info else "?"

    def stop(self, reason: str = "shut down") -> None:
        if self.broken is None:
            self.broken = reason
        for actor in getattr(self, "actors", []):
            with contextlib.suppress(ValueError, ray.exceptions.RayError):  # already gone
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(ValueError, ray.exceptions.RayError):
            remove_placement_group(self.pg)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


# ---------------------------------------------------------------------- the driver's handle
class WorkerGroup:
    """The handle ``Ray.build`` returns: the block's methods, run across the pool's workers."""

    def __init__(self, pool: _PoolWorkers, role: str, kind: Mapping[str, Any]) -> None:
        self._pool, self._role = pool, role
        self._type = kind["type"]
        self._trainer = kind["trainer"]
        self._callables = frozenset(kind["callables"])
        self._attributes = frozenset(kind["attributes"])  # at build time

    @property
    def world_size(self) -> int:
        return self._pool.size

    @property
    def role(self) -> str:
        return self._role

    def __repr__(self) -> str:
        return (
            f"WorkerGroup({self._type} as {self._role!r} on pool {self._pool.name!r}, "
            f"{self.world_size} workers)"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._callables:
            return _Method(self, name)
        if name not in self._attributes:  # as the block itself would answer
            raise AttributeError(f"{self._type} (as {self._role!r}) has no attribute {name!r}")
        rest = [("__noop__", (), {})] * (self.world_size - 1)  # only rank 0 answers
        return self._pool.call(self._role, [("__getattr__", (name,), {}), *rest], name)[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Method(self, "__call__")(*args, **kwargs)

    # ------------------------------------------------------------------ data-parallel methods
    def generate(self, prompts: Sequence[Any], *, n: int = 1, sampling=None, metadata=None):
        """Prompts split into contiguous pieces over the workers; ``Rollouts`` in prompt order."""
        pieces = [p for p in contiguous_partition(len(prompts), self.world_size) if p]
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(
                f"generate: {len(metadata)} metadata entries for {len(prompts)} prompts"
            )
        calls = []
        for rank in range(self.world_size):
            rows = pieces[rank] if rank < len(pieces) else []
            kwargs = {"n": n, "sampling": _rank_seed(sampling, rank)}
            if metadata is not None:
                kwargs["metadata"] = [metadata[i] for i in rows]
            calls.append(("generate", ([prompts[i] for i in rows],), kwargs) if rows else None)
        results = self._pool.call(
            self._role, [c or ("__noop__", (), {}) for c in calls], "generate"
        )
        parts = []
        for rank, result in enumerate(results):
            if calls[rank] is not None:  # renumber groups: prompt i of the batch is group i
                parts.append(result.replace(group_ids=result.group_ids + pieces[rank][0]))
        return parts[0] if len(parts) == 1 else Rollouts.concat(parts)

    def step(self, rollouts: Rollouts, targets, **kwargs: Any) -> dict[str, float]:
        """The one-process ``step`` of a policy or critic trainer, each mini-batch split over
        the ranks balanced by tokens; ``targets`` are the advantages (policy) or the returns
        (critic). Loss, metrics and gradient norm come back for the whole group."""
        if not self._trainer:
            return _Method(self, "step")(rollouts, targets, **kwargs)
        from rlblocks.interfaces import Advantages
        from rlblocks.trainer.batches import minibatch_rows, token_advantages

        rollouts = rollouts.to("cpu")
        if isinstance(targets, Advantages) and self._type == "CriticTrainer":
            targets = targets.returns
        targets = token_advantages(targets, rollouts)  # (b t) float32, masked, detached
        minibatches = kwargs.pop("minibatches", None)
        if minibatches is None:
            c, steps = self.config, self.steps
            minibatches = minibatch_rows(
                len(rollouts), size=c.mini_batch_size, epochs=c.epochs, seed=(c.shuffle_seed, steps)
            )
        calls = []
        for mine, plan in _shares(rollouts, minibatches, self.world_size):
            local = {k: _rows(v, mine, len(rollouts)) for k, v in kwargs.items()}
            local["minibatches"] = plan
            calls.append(("step", (rollouts.select(mine), targets[mine]), local))
        results = self._pool.call(self._role, calls, "step")
        metrics = dict(results[0])  # loss, metrics and grad norm are already group-wide
        for key in ("seconds", "logprob_seconds", "vf_seconds"):
            if key in metrics:
                metrics[key] = max(r[key] for r in results)
        if "tokens_per_second" in metrics:
            metrics["tokens_per_second"] = sum(r["tokens_per_second"] for r in results)
        return metrics

    def named_weights(self):
        """Full weights gathered from the shards (every rank takes part), as a list on the driver."""
        results = self._pool.run(
            self._role,
            _collect_weights,
            [(r == 0,) for r in range(self.world_size)],
            "named_weights",
        )
        return iter(results[0])

    def update_weights(self, weights, *, version: int) -> None:
        weights = [(n, t.detach().cpu()) for n, t in weights]
        call = ("update_weights", (weights,), {"version": version})
        self._pool.call(self._role, [call] * self.world_size, "update_weights")

    def sync_weights_with(self, engine: Any, resharder: Any) -> dict[str, float]:
        """The Resharder's entry point: push this trainer's weights into ``engine``'s workers.

        Same pool (colocated): each worker streams its own trainer's gathered weights into its
        own engine, bucket by bucket. Different pools: the trainer's rank 0 puts the buckets in
        Ray's object store and every engine worker loads them from there.
        """
        if not isinstance(engine, WorkerGroup):
            raise TypeError("a worker-group trainer syncs into a worker-group engine")
        version = resharder.version
        start = time.perf_counter()
        if engine._pool is self._pool:
            results = self._pool.run(
                self._role,
                _colocated_sync,
                [(engine._role, resharder, version)] * self.world_size,
                "sync",
            )
            moved = sum(r["sync/bytes"] for r in results)
            count = results[0]["sync/buckets"]
        else:
            buckets = self._pool.run(
                self._role,
                _gather_to_store,
                [(r == 0, resharder.bucket_bytes) for r in range(self.world_size)],
                "sync (gather)",
            )[0]
            results = engine._pool.run(
                engine._role, _load_from_store, [(buckets, version)] * engine.world_size, "sync"
            )
            moved, count = sum(r for r in results), len(buckets)
        return {
            "sync/seconds": time.perf_counter() - start,
            "sync/bytes": float(moved),
            "sync/buckets": float(count),
            "sync/version": float(version),
        }

    def pids(self) -> list[int]:
        """Process ids of the workers, by rank (for debuggers and tests)."""
        return [info["pid"] for info in self._pool.info]

    def nodes(self) -> list[str]:
        """Ray node id of each rank's worker."""
        return [info["node"] for info in self._pool.info]


class _Method:
    """A block method called through a worker group (see the module docstring for dispatch)."""

    def __init__(self, group: WorkerGroup, name: str) -> None:
        self.group, self.name = group, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        g = self.group
        rollouts = [a for a in args if isinstance(a, Rollouts)]
        if not rollouts or g.world_size == 1:
            calls = [(self.name, args, kwargs)] * g.world_size
            return g._pool.call(g._role, calls, self.name)[0]
        batch = rollouts[0]
        b = len(batch)
        index = balanced_partition(batch.attention_mask.sum(-1).tolist(), g.world_size)
        index = [rows or [0] for rows in index]  # every rank runs (FSDP collectives)
        calls = []
        for rows in index:
            local = tuple(_rows(a, rows, b) for a in args)
            calls.append((self.name, local, {k: _rows(v, rows, b) for k, v in kwargs.items()}))
        results = g._pool.call(g._role, calls, self.name)
        return _gather_result(results, index, b)


def _shares(
    rollouts: Rollouts, minibatches: Sequence[Any], world: int
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Each rank's rows and its local mini-batch plan: every global mini-batch is split over
    the ranks balanced by tokens, and rank r's piece becomes its r-th local mini-batch."""
    lengths = rollouts.attention_mask.sum(-1).tolist()
    pieces: list[list[list[int]]] = [[] for _ in range(world)]
    for rows in minibatches:
        rows = [int(r) for r in rows]
        split = balanced_partition([lengths[r] for r in rows], world)
        if any(not part for part in split):
            raise ValueError(
                f"step: a mini-batch of {len(rows)} rows cannot feed {world} data-parallel "
                "ranks (each needs at least one row); use bigger mini-batches"
            )
        for rank, part in enumerate(split):
            pieces[rank].append([rows[k] for k in part])
    out = []
    for per_minibatch in pieces:
        mine = sorted({r for rows in per_minibatch for r in rows})
        position = {r: i for i, r in enumerate(mine)}
        out.append((mine, [torch.tensor([position[r] for r in rows]) for rows in per_minibatch]))
    return out


def _rows(value: Any, rows: list[int], b: int) -> Any:
    """The rows of a per-row argument (Rollouts, (b ...) tensors); anything else unchanged."""
    if isinstance(value, Rollouts):
        return value.to("cpu").select(rows)
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == b:
        return value.detach().cpu()[rows]
    return value


def _gather_result(results: list, index: list[list[int]], b: int) -> Any:
    first = results[0]
    if isinstance(first, torch.Tensor) and first.dim() >= 1:
        return gather_rows(results, index, b)
    if isinstance(first, tuple):
        fields = [_gather_result([r[i] for r in results], index, b) for i in range(len(first))]
        return type(first)(*fields) if hasattr(first, "_fields") else tuple(fields)
    if isinstance(first, dict) and all(isinstance(v, int | float) for v in first.values()):
        weights = [len(rows) for rows in index]  # row-weighted means of scalar metrics
        return {
            k: sum(w * r[k] for w, r in zip(weights, results, strict=True)) / sum(weights)
            for k in first
        }
    return first


def _rank_seed(sampling: Any, rank: int) -> Any:
    """With a seed, rank r samples with ``seed + r`` (same seed: same noise on every rank)."""
    if sampling is None or getattr(sampling, "seed", None) is None:
        return sampling
    import dataclasses

    return dataclasses.replace(sampling, seed=sampling.seed + rank)


# ---------------------------------------------------------------------- inside the workers
class _Worker:
    """One worker process (a Ray actor): the blocks of every role of its pool, by role."""

    def __init__(self, pool: str, rank: int, size: int, threads: int) -> None:
        self.pool, self.rank, self.size = pool, rank, size
        torch.set_num_threads(threads)
        self.blocks: dict[str, Any] = {}
        self.node = ray.get_runtime_context().get_node_id()

    def info(self) -> dict[str, Any]:
        with socket.socket() as s:  # a free port for rank 0's rendezvous
            s.bind(("", 0))
            port = s.getsockname()[1]
        ip = ray.util.get_node_ip_address()
        return {"ip": ip, "port": port, "node": self.node, "pid": os.getpid()}

    def init_process_group(self, init_method: str, backend: str, timeout: float) -> None:
        import torch.distributed as dist

        if backend == "nccl":  # Ray shows each worker only its own GPU(s): cuda:0 is ours
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.size,
            timeout=timedelta(seconds=timeout),
        )

    def build(self, role: str, factory: Callable, args: tuple, kwargs: dict, fsdp: FSDP):
        def make():
            from rlblocks.critic import CriticTrainer
            from rlblocks.trainer import PolicyTrainer
            from rlblocks.trainer.parallel import DataParallel, shard

            self.blocks.pop(role, None)  # rebuilding a role: free the old block first
            block = factory(*args, **kwargs)
            trainer = isinstance(block, PolicyTrainer | CriticTrainer)
            if trainer and (self.size > 1 or fsdp != FSDP()) and not _single_lora(block, self):
                shard(block, DataParallel(), fsdp)
            self.blocks[role] = block
            callables = [n for n in dir(block) if not n.startswith("_") and _is_method(block, n)]
            if callable(block):
                callables.append("__call__")
            public = [n for n in dir(block) if not n.startswith("_")]
            return {
                "type": type(block).__name__,
                "trainer": trainer,
                "callables": callables,
                "attributes": public,
            }

        return self._guard(role, "build", make)

    def call(self, role: str, method: str, args: tuple, kwargs: dict) -> Any:
        if method == "__noop__":
            return None

        def invoke():
            block = self._block(role)
            if method == "__getattr__":
                return getattr(block, args[0])
            return getattr(block, method)(*args, **kwargs)

        return self._guard(role, method, invoke)

    def run(self, role: str, fn: Callable, args: tuple) -> Any:
        """``fn(role's block, this worker, *args)``."""
        call = getattr(fn, "__name__", "run").strip("_")
        return self._guard(role, call, lambda: fn(self._block(role), self, *args))

    def _block(self, role: str) -> Any:
        if role not in self.blocks:
            raise KeyError(f"no block built for role {role!r} in this worker")
        return self.blocks[role]

    def _guard(self, role: str, call: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every error goes back to the driver, with its rank
            raise WorkerError(
                role,
                self.rank,
                self.node[:8],
                call,
                f"{type(e).__name__}: {e}",
                traceback.format_exc(),
            ) from None


def _is_method(block: Any, name: str) -> bool:
    return callable(getattr(type(block), name, None))


def _single_lora(block: Any, worker: _Worker) -> bool:
    """A LoRA policy alone in its pool trains unsharded (FSDP does not take peft models yet)."""
    from rlblocks.trainer.lora import is_peft_model

    return worker.size == 1 and is_peft_model(block.model)


def _collect_weights(trainer: Any, worker: _Worker, keep: bool) -> list | None:
    """Every rank gathers (the all-gathers are collective); rank 0 keeps copies."""
    out = []
    for name, tensor in trainer.named_weights():
        if keep:
            out.append((name, tensor.detach().cpu().clone()))
    return out if keep else None


def _colocated_sync(
    trainer: Any, worker: _Worker, engine_role: str, resharder: Any, version: int
) -> dict:
    return resharder.push(trainer, worker._block(engine_role), version=version)


def _gather_to_store(trainer: Any, worker: _Worker, keep: bool, bucket_bytes: int) -> list | None:
    from rlblocks.resharder.bucketed import buckets, trainer_weights

    refs = []
    for bucket in buckets(trainer_weights(trainer, bucket_bytes), bucket_bytes):
        if keep:
            refs.append(ray.put([(n, t.detach().cpu()) for n, t in bucket]))
    return refs if keep else None


def _load_from_store(engine: Any, worker: _Worker, refs: list, version: int) -> int:
    moved = 0
    for ref in refs:
        bucket = ray.get(ref)
        moved += sum(t.numel() * t.element_size() for _, t in bucket)
        engine.update_weights(bucket, version=version)
    return moved
