"""What a local ``Ray(...)`` placement exposes on the network, and what a call after the end does.

Real sockets: the listening sockets of this process and of every process the placement started
(GCS, raylet, agents, workers) are read with psutil after a 2-worker pool has run a gloo
all-reduce, so the pool's ``torch.distributed`` rendezvous store and gloo's own listeners exist.
A local placement must listen on the loopback interface only. After ``placement.shutdown()`` (or
``ray.shutdown()``) a call on a handle is refused at once; before, it started a new local Ray
instance (``ray.put`` initializes Ray when it is not running) on every interface.
"""

from __future__ import annotations

import ipaddress
import time

import psutil
import pytest
import ray

import rlblocks as rb
from rlblocks.placement import PoolBroken

# Slow (about 35 s together): .ci/run runs them in its Ray step.
pytestmark = [pytest.mark.ray, pytest.mark.slow]


class Summer:
    """A block whose one method is a collective over the pool's process group."""

    def total(self, x: float) -> float:
        import torch
        import torch.distributed as dist

        value = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(value)
        return float(value)


def _listening(processes: list[psutil.Process]) -> dict[tuple[int, int], str]:
    """(pid, port) -> address of every listening TCP socket of ``processes``."""
    found = {}
    for process in processes:
        try:
            connections = process.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN:
                found[(process.pid, conn.laddr.port)] = conn.laddr.ip
    return found


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return (mapped or ip).is_loopback


def _ray_servers() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.name() in ("gcs_server", "raylet")
    }


def test_a_local_placement_listens_on_loopback_only_and_refuses_calls_after_shutdown():
    me = psutil.Process()
    earlier = {p.pid for p in me.children(recursive=True)}  # not the placement's
    ours_before = set(_listening([me]))
    placement = rb.placement.Ray(workers=2)
    try:
        group = placement.build("actor", Summer)
        assert group.total(1.5) == 3.0  # a gloo all-reduce over both workers
        started = [p for p in me.children(recursive=True) if p.pid not in earlier]
        listening = {
            key: ip for key, ip in _listening([me, *started]).items() if key not in ours_before
        }
        rank0 = group.pids()[0]
        store = placement._groups["default"].info[0]["port"]
        assert (rank0, store) in listening  # the rendezvous store was seen
        assert {pid for pid, _ in listening} >= set(group.pids()) | _ray_servers()
        exposed = {key: ip for key, ip in listening.items() if not _is_loopback(ip)}
        assert exposed == {}, exposed  # before: rank 0's store listened on "::"
    finally:
        placement.shutdown()
    assert not ray.is_initialized()
    start = time.monotonic()
    with pytest.raises(PoolBroken) as refused:
        group.total(1.0)
    # Before: ray.put started a new local Ray instance (on every interface), then refused.
    assert not ray.is_initialized() and _ray_servers() == set()
    assert time.monotonic() - start < 1.0
    assert "placement.shutdown()" in str(refused.value), refused.value
    assert "create a new rb.placement.Ray" in str(refused.value), refused.value
    with pytest.raises(RuntimeError, match=r"Ray\.build: .*shut down"):
        placement.build("actor", Summer)
    assert not ray.is_initialized() and _ray_servers() == set()


def test_a_handle_whose_ray_instance_was_stopped_refuses_calls_without_starting_one():
    # address="local" is Ray's word for "start a new instance here", not a cluster's address:
    # before, it went to ray.init as it was, and the instance listened on every interface.
    me = psutil.Process()
    earlier = {p.pid for p in me.children(recursive=True)}
    placement = rb.placement.Ray(address="local", workers=1)
    try:
        group = placement.build("actor", Summer)
        assert group.total(2.0) == 2.0
        started = [p for p in me.children(recursive=True) if p.pid not in earlier]
        listening = _listening(started)
        assert {pid for pid, _ in listening} >= _ray_servers()
        exposed = {key: ip for key, ip in listening.items() if not _is_loopback(ip)}
        assert exposed == {}, exposed
        ray.shutdown()  # behind the placement's back
        start = time.monotonic()
        with pytest.raises(PoolBroken) as refused:
            group.total(1.0)
        assert not ray.is_initialized() and _ray_servers() == set()
        assert time.monotonic() - start < 1.0
        assert "the Ray instance it ran on is gone" in str(refused.value), refused.value
    finally:
        placement.shutdown()
    assert not ray.is_initialized()
