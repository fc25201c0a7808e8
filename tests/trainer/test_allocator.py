"""rlblocks.trainer.allocator: freed host memory is reused, not faulted in again every step."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from rlblocks.trainer.allocator import keep_freed_memory
kept = keep_freed_memory()
for _ in range(2):  # warm up: the first allocation faults in either way
    torch.ones(64 << 20 >> 2)  # 64 MiB, above glibc's largest default mmap threshold
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(64 << 20 >> 2)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: str) -> tuple[bool, int]:
    env = {**os.environ, "RLBLOCKS_KEEP_FREED_MEMORY": keep, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    kept, faults = out.stdout.split()
    return kept == "True", int(faults)


def _transparent_huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


PAGES = (64 << 20) // 4096  # one 64 MiB tensor in 4 KiB pages: 16,384 faults to touch it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
@pytest.mark.skipif(_transparent_huge_pages_always(), reason="2 MiB pages: few faults either way")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    # 10 allocations of 64 MiB. glibc maps each afresh and the kernel faults all its pages in:
    # measured 10 · PAGES (+ a few). Kept, they come from the heap already in place: measured
    # one allocation's pages at most (the heap grows once more), 0 on other runs.
    kept, faults = _faults("1")
    off, faults_off = _faults("0")
    assert kept and not off
    assert faults <= 2 * PAGES, faults
    assert faults_off >= 8 * PAGES, faults_off


TRAINER_PROBE = """
import resource, torch
import rlblocks as rb
policy = rb.trainer.PolicyTrainer.from_pretrained("tiny", device="cpu", reference=None)
for _ in range(2):
    torch.ones(64 << 20 >> 2)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(64 << 20 >> 2)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
@pytest.mark.skipif(_transparent_huge_pages_always(), reason="2 MiB pages: few faults either way")
@pytest.mark.parametrize("keep", [None, "1"])
def test_a_trainer_changes_malloc_only_when_asked(keep, tmp_path):
    # The settings hold for the whole process, so a PolicyTrainer imported into a program of
    # one's own leaves malloc alone (before, every CPU trainer applied them); the main job opts
    # in with RLBLOCKS_KEEP_FREED_MEMORY=1. The probe's 64 MiB tensors are not the trainer's:
    # they show what the process's malloc does. Bounds as in the test above.
    env = {k: v for k, v in os.environ.items() if k != "RLBLOCKS_KEEP_FREED_MEMORY"}
    env |= {"OMP_NUM_THREADS": "1", "RLBLOCKS_CACHE": str(tmp_path)}
    if keep is not None:
        env["RLBLOCKS_KEEP_FREED_MEMORY"] = keep
    out = subprocess.run(
        [sys.executable, "-c", TRAINER_PROBE], env=env, capture_output=True, text=True, check=True
    )
    faults = int(out.stdout.split()[-1])
    if keep == "1":
        assert faults <= 2 * PAGES, faults
    else:
        assert faults >= 8 * PAGES, faults
