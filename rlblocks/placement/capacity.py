"""Room for a pool on the cluster: reserve it, or say within seconds why it cannot be had.

Ray waits for a placement group as long as it is asked to. A notebook cell re-run builds a
second ``Ray(...)`` placement while the first still holds the CPUs, and would wait for minutes.
`reserve` instead:

- fails at once, naming them, when the new pool does not fit beside pools that placements of
  this process still hold (a registry of the started pools, held by weak reference);
- waits `GRACE_SECONDS` when the cluster has too little free for the pool (a pool just stopped
  may still be giving its resources back), else up to `WAIT_SECONDS` (the cluster has room in
  total, and Ray may need a moment to pack the bundles);
- then fails with what was asked and what the cluster has, free and in all.

A cluster that adds nodes on demand (an autoscaler) gets `GRACE_SECONDS` too: start its nodes
before building a pool that needs them.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

GRACE_SECONDS = 5.0  # when the cluster lacks free resources for the pool
WAIT_SECONDS = 120.0  # when it has them in total and Ray still packs the bundles
_SHOWN = ("CPU", "GPU")  # resources named in messages (besides those a pool asks for)


class Holder(Protocol):
    """A started pool as the registry sees it (`rlblocks.placement.pool.Workers`)."""

    broken: str | None
    owner: str
    name: str
    bundle: dict[str, float]
    nodes: int
    session: tuple[str, str]


_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()


def hold(holder: Holder) -> None:
    """Record a started pool; it counts as holding resources until ``holder.broken`` is set."""
    _HOLDERS.add(holder)


def holders() -> list[Holder]:
    """The pools of this process that hold resources on the Ray instance it is connected to."""
    now = session()
    return [h for h in list(_HOLDERS) if h.broken is None and h.session == now]


def session() -> tuple[str, str]:
    """(node id, job id) of this driver: a new Ray instance or a new connection differs."""
    context = ray.get_runtime_context()
    return context.get_node_id(), context.get_job_id()


def reserve(name: str, bundle: dict[str, float], nodes: int) -> PlacementGroup:
    """A ready placement group of ``nodes`` × ``bundle`` (``STRICT_SPREAD`` over nodes when
    ``nodes > 1``, else ``STRICT_PACK``), or ``RuntimeError`` within seconds saying why not."""
    short = shortfall(bundle, nodes)
    busy = holders() if short else []
    if busy and _fits_without(bundle, nodes, busy):
        raise RuntimeError(_busy_message(name, bundle, nodes, busy))
    strategy = "STRICT_SPREAD" if nodes > 1 else "STRICT_PACK"
    pg = placement_group([dict(bundle) for _ in range(nodes)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=GRACE_SECONDS if short else WAIT_SECONDS)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        waited = GRACE_SECONDS if short else WAIT_SECONDS
        raise RuntimeError(
            f"Ray: pool {name!r} cannot be placed (waited {waited:.0f} s): it asks for "
            f"{nodes} node(s) with {_show(bundle)} each; {short or _summary(bundle)}"
        ) from None
    return pg


def shortfall(bundle: Mapping[str, float], nodes: int) -> str | None:
    """Why ``nodes`` bundles cannot be placed now, or None when the cluster seems to have room:
    fewer than ``nodes`` nodes big enough for one bundle, or too little free in all."""
    totals = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    big_enough = sum(all(t.get(k, 0.0) >= v for k, v in bundle.items()) for t in totals)
    if big_enough < nodes:
        return f"only {big_enough} of the cluster's {len(totals)} node(s) can hold one; " + (
            _summary(bundle)
        )
    free = ray.available_resources()
    if any(free.get(k, 0.0) < v * nodes for k, v in bundle.items()):
        return _summary(bundle)
    return None


def _fits_without(bundle: Mapping[str, float], nodes: int, busy: list[Holder]) -> bool:
    """Whether the pool would fit (in total) if the ``busy`` pools were stopped."""
    free = dict(ray.available_resources())
    for holder in busy:
        for key, value in holder.bundle.items():
            free[key] = free.get(key, 0.0) + value * holder.nodes
    return all(free.get(k, 0.0) >= v * nodes for k, v in bundle.items())


def _summary(bundle: Mapping[str, float]) -> str:
    keys = [*_SHOWN, *(k for k in bundle if k not in _SHOWN)]
    free, total = ray.available_resources(), ray.cluster_resources()
    return f"the cluster has {_show(free, keys)} free of {_show(total, keys)}"


def _show(resources: Mapping[str, float], keys: Any = None) -> str:
    keys = list(resources) if keys is None else keys
    return "{" + ", ".join(f"{k}: {resources.get(k, 0.0):g}" for k in keys) + "}"


def _busy_message(name: str, bundle: dict[str, float], nodes: int, busy: list[Holder]) -> str:
    held = "; ".join(f"pool {h.name!r} ({_show(h.bundle)} per node) of {h.owner}" for h in busy)
    return (
        f"Ray: pool {name!r} needs {nodes} node(s) with {_show(bundle)} free, but placements "
        f"made earlier in this process still hold them: {held}. Stop the old one with "
        "placement.shutdown(), or build placements as `with rb.placement.Ray(...) as "
        "placement:` so that they stop when the cell ends; or reuse it (placement.build(...) "
        "again replaces a role's block). If re-running a cell rebound its name, ray.shutdown() "
        f"stops every pool of this process. Now {_summary(bundle)}."
    )
