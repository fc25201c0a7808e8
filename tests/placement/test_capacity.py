"""A local ``Ray(...)`` placement: a second one beside a live one, a pool too big for the
machine (both fail within seconds, saying why), and a Ray instance that listens on 127.0.0.1
only."""

import os
import time

import psutil
import pytest
import ray

import rlblocks as rb
from rlblocks.placement import Pool
from rlblocks.placement.capacity import GRACE_SECONDS

pytestmark = pytest.mark.ray

CPUS = os.cpu_count() or 1


class Counter:
    """A block with nothing to load: enough to start a pool."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, n: int) -> int:
        self.count += n
        return self.count


@pytest.fixture(scope="module")
def first():
    """A local placement whose one pool holds every CPU of the Ray instance it starts."""
    placement = rb.placement.Ray(pools={"default": Pool(cpus_per_worker=CPUS)})
    placement.build("actor", Counter)
    yield placement
    placement.shutdown()


def _fails_within(seconds: float, placement, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=match):
        placement.build("actor", Counter)
    assert time.monotonic() - start < seconds


def test_a_second_placement_fails_at_once_naming_the_live_one(first):
    # Before: Ray waited 120 s for the CPUs the first placement holds, then printed a dict.
    second = rb.placement.Ray(workers=1)
    message = (
        r"pool 'default' needs 1 node\(s\) with \{CPU: 1\} free, but placements made earlier "
        rf"in this process still hold them: pool 'default' \(\{{CPU: {CPUS}\}} per node\) of "
        r"Ray\(local, .*placement\.shutdown\(\).*with rb\.placement\.Ray"
    )
    _fails_within(2.0, second, message)
    assert first.build("actor", Counter).add(2) == 2  # the first is untouched, and reusable


def test_a_pool_too_big_for_the_machine_fails_within_seconds(first):
    # No machine here has 64 GPUs: not a matter of the first placement, so it is not named.
    big = rb.placement.Ray(pools={"big": Pool(gpus_per_worker=64)})
    message = (
        r"pool 'big' cannot be placed \(waited 5 s\): it asks for 1 node\(s\) with "
        r"\{CPU: 1, GPU: 64\} each; only 0 of the cluster's 1 node\(s\) can hold one; the "
        rf"cluster has \{{CPU: 0, GPU: \d+\}} free of \{{CPU: {CPUS}, GPU: \d+\}}"
    )
    _fails_within(GRACE_SECONDS + 5.0, big, message)


def test_the_local_ray_instance_listens_on_loopback_only(first):
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    # torch.distributed's rendezvous store in rank 0 included (tests/placement/test_ray_network.py
    # checks a pool of two workers and every process the placement started).
    listening = {}  # (process name, port) -> address of each listening socket of Ray's processes
    for process in psutil.Process().children(recursive=True):
        if process.name() in ("gcs_server", "raylet") or process.name().startswith("ray::"):
            for conn in process.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    listening[(process.name(), conn.laddr.port)] = conn.laddr.ip
    names = {name for name, _ in listening}
    assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names)
    assert set(listening.values()) <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
