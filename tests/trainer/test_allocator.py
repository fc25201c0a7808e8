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
