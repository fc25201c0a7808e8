"""Colocated syncs of an FSDP2 policy gather through shared memory, not gloo's TCP.

Each run is a real job (colocated_sync_job.py): two spawned gloo ranks, each with a sharded
policy (5.5 MB of float32 weights) and its own engine, synced three times. Its first run is
made inside a fresh network namespace (``unshare -rn``), whose loopback interface carries only
these ranks' bytes; a second run puts the ranks in two pid namespaces, where no rank can open
another's ``/proc``, so the group must keep gloo's all-gather.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

JOB = Path(__file__).with_name("colocated_sync_job.py")
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}


def namespaces(*flags: str) -> bool:
    """Whether this user may make the namespaces of ``unshare`` ``flags`` here."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", *flags, "true"], capture_output=True, check=False)
    return probe.returncode == 0


def run(command: list[str]) -> None:
    done = subprocess.run(
        command, env=ENV, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def isolated(tmp_path_factory) -> dict:
    """The job's result, from a fresh network namespace where one can be made ("isolated")."""
    out = tmp_path_factory.mktemp("isolated") / "result.pt"
    python = [sys.executable, str(JOB), str(out)]
    if namespaces("-rn"):  # loopback starts down in a new namespace: bring it up first
        run(["unshare", "-rn", sys.executable, "-c", UP_AND_RUN, *python])
    else:
        run(python)
    return {**torch.load(out, weights_only=False), "isolated": namespaces("-rn")}


# Sets the loopback interface up (SIOCGIFFLAGS / SIOCSIFFLAGS, IFF_UP), then runs argv[1:].
UP_AND_RUN = """
import fcntl, os, socket, struct, sys
s = socket.socket()
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0))[:18])[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_a_colocated_sync_sends_no_weights_over_the_network(isolated):
    if not isolated["isolated"]:
        pytest.skip("unshare -rn is not allowed here: the loopback counters would be shared")
    # Between the two counter reads the ranks gather the whole model seven times (three
    # syncs, three checks, one kept gather). Through gloo each gather carries every rank's
    # shard to the other: at least the model's bytes per gather, 7 x 5.5 MB in all (37 MB
    # measured on the old path). Through shared memory only the collectives' control messages
    # cross the loopback (about 120 kB measured: a few small messages per bucket).
    assert isolated["loopback_bytes"] < isolated["weight_bytes"] / 4


def test_every_sync_gives_the_engine_the_trainers_weights(isolated):
    assert isolated["synced"] == [True, True, True]
    assert isolated["sync_bytes"] == [isolated["weight_bytes"]] * 3


def test_later_syncs_reuse_the_shared_memory_of_the_first(isolated):
    # The speed comes from writing into memory already mapped (fresh pages cost a fault
    # each): after the first sync and its check, the second maps no new slab.
    first, second, _ = isolated["mapped"]
    assert first, "no shared-memory slab was mapped: the gather went through gloo"
    assert second == first


def test_gathered_tensors_outlive_the_gathers_after_them(isolated):
    # A gather's tensors are kept (85 buckets of 64 KiB), the weights change and a sync
    # gathers again: the kept tensors keep the old values, as gloo's fresh buffers did.
    assert isolated["kept_unchanged"]
    assert isolated["kept_is_old"]
    assert len(isolated["mapped"][2]) > len(isolated["mapped"][1])  # held slabs not reused


def test_uneven_rows_and_a_rank_without_rows_are_gathered_whole(isolated):
    # 7 rows (4 + 3), 1 row (rank 1 holds none), a vector of 11 (6 + 5), as FSDP2 splits them.
    assert isolated["rows"] == [True, True, True]


@pytest.mark.skipif(not namespaces("-rpf", "--mount-proc"), reason="unshare -rpf not allowed")
def test_ranks_that_cannot_map_each_others_memory_keep_gloo(tmp_path):
    # Rank 1 runs in its own pid namespace: rank 0's /proc/<pid>/fd is not there, the probe
    # fails on rank 1, and both ranks (the answer is all-gathered) keep gloo's all-gather.
    out, store = tmp_path / "result.pt", tmp_path / "store"
    python = [sys.executable, str(JOB), str(out), "--store", str(store), "--rank"]
    with open(tmp_path / "rank0.log", "w") as log:
        rank0 = subprocess.Popen([*python, "0"], env=ENV, stdout=log, stderr=log)
        try:
            run(["unshare", "-rpf", "--mount-proc", *python, "1"])
            assert rank0.wait(timeout=300) == 0, (tmp_path / "rank0.log").read_text()[-3000:]
        finally:
            rank0.kill()
            rank0.wait()
    result = torch.load(out, weights_only=False)
    assert result["mapped"] == [[], [], []]  # rank 0 mapped nothing either
    assert result["rows"] == []
    assert result["synced"] == [True, True, True]
    assert result["kept_unchanged"] and result["kept_is_old"]
