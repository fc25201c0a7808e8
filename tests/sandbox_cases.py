"""The guard of the sandbox tests: every case is contained and leaves nothing behind.

`no_leftovers` (used by every sandbox test module): after the test, no process runs as one of
this test process's sandbox uids (programs and checkers), no descendant of the test process is
alive (the test process is made a child subreaper, so an orphan would be re-parented to it
rather than vanish from view), and no ``rlblocks-sandbox-*`` folder is left in the test's own
temporary root (`Sandbox.run` makes its folders with `tempfile.mkdtemp`, pointed there for the
test, so that such folders made in /tmp by other processes on the machine are never counted).
`nothing_left` asserts the first two at once, at the moment `Sandbox.run` returns.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
from proc_helpers import live_descendants

from rlblocks.rewards.sandbox import SLOTS, UID_BASE, Sandbox, SandboxLimits

PR_SET_CHILD_SUBREAPER = 36
FAST = SandboxLimits(cpu_seconds=2, wall_seconds=3.0, memory_bytes=256 << 20, processes=16)
REPO = Path(__file__).resolve().parents[1]
CHECKERS = 2_000_000  # sandbox_runner.CHECKER_UID_OFFSET: a checker's uid is its program's + this


def _proc_field(pid: str, name: str) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return line.split()[1]
    except OSError:  # exited while we read
        return None
    return None


def sandbox_processes() -> list[int]:
    """Live processes whose real uid is one of this test process's sandbox uids (its
    programs' and their checkers')."""
    first = UID_BASE + (os.getpid() % 20_000) * SLOTS
    ranges = [range(first, first + SLOTS), range(first + CHECKERS, first + CHECKERS + SLOTS)]
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            uid = _proc_field(entry.name, "Uid")
            state = _proc_field(entry.name, "State")
            if uid and state and any(int(uid) in r for r in ranges) and state not in "ZX":
                found.append(int(entry.name))
    return found


def sandbox_folders(root: Path) -> set[Path]:
    return set(root.glob("rlblocks-sandbox-*"))


_BASELINE: set[int] = set()  # our descendants before the test (e.g. a Ray started earlier)


def nothing_left() -> None:
    """Assert, now, that no sandboxed process and no new descendant of ours is alive."""
    assert sandbox_processes() == []
    assert live_descendants(os.getpid()) - _BASELINE == set()


@pytest.fixture
def no_leftovers(monkeypatch, tmp_path_factory):
    # pytest's tmp_path root first, in the real temporary folder: made later, it would land in
    # (and be removed with) the root below.
    tmp_path_factory.getbasetemp()
    # The test's own temporary root, in the system's (not pytest's tmp_path: its parent is 0700,
    # and the sandbox uid must reach the folder it runs in without namespaces); searchable by
    # all, listable by us only.
    root = Path(tempfile.mkdtemp(prefix="rlblocks-test-tmp-"))
    root.chmod(0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    threads = set(threading.enumerate())
    _BASELINE.clear()
    _BASELINE.update(live_descendants(os.getpid()))
    yield
    try:
        nothing_left()
        assert sandbox_folders(root) == set(), "sandbox folders were left behind"
        assert set(threading.enumerate()) <= threads, "threads outlived the test"
    finally:
        while True:  # orphans re-parented to us (zombies by now): reap them
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def box() -> Sandbox:
    box = Sandbox(FAST, workers=2)
    if box.run("print(1)").isolation == "none":
        pytest.skip("no namespaces here: the hostile suite needs them (see the fallback tests)")
    return box


CONTAINED = ("PermissionError", "FileNotFoundError")  # refused, or not visible in the sandbox


@pytest.fixture
def outside():
    """A folder outside the sandbox, owned by us, like a home or a project folder (0755)."""
    folder = Path(tempfile.mkdtemp(prefix="outside-", dir=REPO))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def readable_by_all(path: Path) -> bool:
    """Every folder above ``path`` searchable, and ``path`` readable, by any user."""
    return all(p.stat().st_mode & 0o001 for p in path.parents) and path.stat().st_mode & 0o004


# The start of a script that loads rlblocks/rewards/sandbox.py (its path in argv[1]) by path,
# under an interpreter that cannot import rlblocks' dependencies (the system's, as nobody).
LOAD_SANDBOX = """
import importlib.util, json, sys, types
from pathlib import Path

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module

# sandbox.py and its sibling sandbox_cgroup.py need only the standard library; the package
# around them (torch...) is not importable here, so it is stood in for by empty modules.
for name in ("rlblocks", "rlblocks.rewards"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["rlblocks.rewards"].sandbox_cgroup = load(
    "rlblocks.rewards.sandbox_cgroup", Path(sys.argv[1]).with_name("sandbox_cgroup.py")
)
sandbox = load("sandbox", sys.argv[1])
"""
