"""Colocated syncs of an FSDP2-sharded policy, one engine per rank, for test_shared_gather.py.

    python colocated_sync_job.py OUT                          # spawns both ranks
    python colocated_sync_job.py OUT --rank R --store FILE    # runs rank R only

Both ranks join one gloo group (a ``file://`` rendezvous), run :func:`syncs` and rank 0 writes
what it saw to OUT (``torch.save``). The test runs the job as it is, inside a fresh network
namespace (``unshare -rn``: the loopback counters then see only these ranks), or with its
ranks in two pid namespaces (each started with ``--rank``), where no rank can open another's
``/proc``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: builders

import torch
import torch.distributed as dist
from builders import tiny_trainer

import rlblocks as rb

# 5.5 MB of float32 weights; the MLP's 511 rows split 256 + 255 over two ranks.
MODEL = {"hidden_size": 256, "intermediate_size": 511}
BUCKET_MB = 3.0  # buckets of a layer or more (the resharder never splits one), as in use
WORLD = 2
KEPT_BUCKET = 2**16  # a gather of 85 buckets of 64 KiB, all kept


def loopback_bytes() -> int:
    """Bytes received on this network namespace's loopback interface so far."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[0])
    return -1


def gather_mappings() -> set[str]:
    """The shared-memory slabs this process has mapped (``rlblocks.trainer.shared_gather``),
    by inode: each appears in ``/proc/self/maps`` as ``/memfd:rlblocks-gather (deleted)``."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {line.split()[4] for line in maps if re.search(r"memfd:rlblocks-gather", line)}


def weights_of(trainer) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in trainer.named_weights()}


def syncs(rank: int) -> dict:
    """Three syncs into a zeroed engine, the weights changed in between; before the last, a
    gather whose tensors are all kept, to check they survive the later gathers."""
    trainer = tiny_trainer(model_config=MODEL)
    trainer.shard()
    model, tokenizer = rb.models.tiny(seed=1, **MODEL)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    engine = rb.rollout.HFEngine(model, tokenizer, progress=False)
    resharder = rb.resharder.Resharder(bucket_mb=BUCKET_MB)
    dist.barrier()
    start = loopback_bytes()
    synced, mapped, sync_bytes = [], [], []
    kept = copies = None
    for round_ in range(3):
        if round_ == 2:  # held through the last sync, which reuses the free slabs
            kept = dict(trainer.named_weights(bucket_bytes=KEPT_BUCKET))
            copies = {name: value.clone() for name, value in kept.items()}
        if round_:
            with torch.no_grad():  # every shard of every weight changes
                for p in trainer.model.parameters():
                    p.mul_(0.5).add_(round_)
        sync_bytes.append(resharder.sync(trainer, engine)["sync/bytes"])
        held = engine.model.state_dict()
        synced.append(all(torch.equal(held[n], v) for n, v in trainer.named_weights()))
        mapped.append(gather_mappings())
    dist.barrier()
    moved = loopback_bytes() - start
    whole = weights_of(trainer)
    return {
        "rows": rows(rank),
        "synced": synced,
        "mapped": [sorted(m) for m in mapped],
        "loopback_bytes": moved,
        "weight_bytes": sum(v.numel() * v.element_size() for v in whole.values()),
        "sync_bytes": sync_bytes,
        "kept_unchanged": all(torch.equal(kept[n], copies[n]) for n in copies),
        "kept_is_old": all(not torch.equal(kept[n], whole[n]) for n in copies),
    }


def rows(rank: int) -> list[bool]:
    """``gather_rows`` on dim-0 chunks of known tensors, ``torch.chunk``'s split as FSDP2's:
    7 rows (4 + 3 over two ranks), 1 row (the last rank holds none), a vector of 11."""
    from rlblocks.trainer.shared_gather import gather_rows, shared_group

    size = dist.get_world_size()
    wholes = [
        torch.arange(7 * 3, dtype=torch.float64).reshape(7, 3),
        torch.arange(5, dtype=torch.float64).reshape(1, 5) + 100,
        torch.arange(11, dtype=torch.float64) - 50,
    ]
    owner = shared_group(None)
    locals_ = []
    for whole in wholes:
        chunks = whole.chunk(size)
        locals_.append(chunks[rank] if rank < len(chunks) else whole[:0])
    if owner is None:  # no shared memory in this group: nothing to check here
        return []
    got = gather_rows(locals_, [w.shape for w in wholes], group=None, owner=owner)
    return [torch.equal(a, b) for a, b in zip(got, wholes, strict=True)]


def run_rank(rank: int, world: int, out: str, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        result = syncs(rank)
        if rank == 0:
            torch.save(result, out)
        dist.barrier()  # nobody leaves while a peer still maps its slabs or talks to it
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/dp_cases.py: no C++ teardown of gloo/FSDP state at exit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rank", type=int, default=None, help="run this rank only (with --store)")
    p.add_argument("--store", default=None, help="the rendezvous file (with --rank)")
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a fresh namespace has nothing else
    if args.rank is not None:
        run_rank(args.rank, WORLD, args.out, args.store)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.spawn(run_rank, args=(WORLD, args.out, store), nprocs=WORLD)


if __name__ == "__main__":
    main()
