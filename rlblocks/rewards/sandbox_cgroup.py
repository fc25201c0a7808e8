"""A memory limit over a whole sandboxed run: a cgroup for each sandbox slot, where one can be made.

The kernel's ``RLIMIT_AS`` bounds one process; a run whose program forks holds up to
``processes × memory_bytes``. A memory cgroup bounds the run's processes together, the
tmpfs pages they write included, and the kernel's OOM killer ends a process of the run at the
limit. Where this process may make one, each sandbox slot gets a cgroup of its own below
this process's cgroup (never elsewhere in the hierarchy: the caller's own limits still hold
around it), made at the slot's first run and reused after (making and removing a memory
cgroup per run leaves the kernel "dying" cgroups to collect), removed at exit:

- **cgroup v2** (``memory.max``, ``memory.swap.max`` 0, ``memory.oom.group`` 1: the whole run
  is killed at once), where this process's cgroup lists ``memory`` in its controllers and
  can pass it to children (``cgroup.subtree_control``);
- **cgroup v1** (``memory.limit_in_bytes``, and ``memory.memsw.limit_in_bytes`` where swap
  is accounted), where the v1 memory hierarchy is mounted and this process's group in it is
  writable (root, usually);
- neither: `slot_group` gives None, and the runner's pid 1 sums the run's resident memory
  instead (`sandbox_runner`).

A run went over when the group's count of OOM kills (``oom_kill`` in ``memory.events`` or
``memory.oom_control``) grew during it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """One slot's cgroup."""

    path: Path
    version: int

    @property
    def procs(self) -> str:
        """The file a process writes ``0`` to, to join the group."""
        return str(self.path / "cgroup.procs")

    def oom_kills(self) -> int:
        """How many times the kernel's OOM killer ended a process of this group so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0


_groups: dict[tuple[int, int, int], Group | None] = {}
_lock = threading.Lock()


def slot_group(slot: int, memory_bytes: int) -> Group | None:
    """The cgroup of sandbox ``slot`` limited to ``memory_bytes`` (made on first use), or
    None where no cgroup can be made here."""
    base = _base()
    if base is None:
        return None
    key = (os.getpid(), slot, memory_bytes)  # a forked child makes its own
    with _lock:
        _sweep_stale(base)
        if key not in _groups:
            _groups[key] = _make(base, f"rlblocks-sandbox-{os.getpid()}-{slot}-{memory_bytes}",
                                 memory_bytes)  # fmt: skip
        return _groups[key]


_swept: set[Path] = set()


def _sweep_stale(base: Group) -> None:
    """Once per process: remove the slot cgroups below ``base`` of processes that no longer
    run (killed before their exit handler removed them). ``rmdir`` of a cgroup that still holds
    a process fails: such a group stays."""
    if base.path in _swept:
        return
    _swept.add(base.path)
    try:
        children = list(base.path.iterdir())
    except OSError:
        return
    for child in children:
        found = re.fullmatch(r"rlblocks-sandbox-(\d+)-\d+-\d+", child.name)
        if found and int(found[1]) != os.getpid() and pid_gone(int(found[1])):
            _remove(Group(child, base.version))


def pid_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def available() -> int | None:
    """The cgroup version (2 or 1) that bounds a run's memory here, or None (pid 1's watch)."""
    base = _base()
    return base.version if base else None


@functools.cache
def _base() -> Group | None:
    """This process's own cgroup, v2 if it can give children a memory limit, else v1."""
    mounts, mine = _mounts(), {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "" or "memory" in controllers.split(","):
            mine[2 if controllers == "" else 1] = path
    for version in (2, 1):
        mount, own = mounts.get(version), mine.get(version)
        if mount and own is not None and own.startswith(mount[1]):
            folder = Path(mount[0] + "/" + own[len(mount[1]) :].lstrip("/"))
            if _usable(folder, version):
                return Group(folder, version)
    return None


def _mounts() -> dict[int, tuple[str, str]]:
    """{version: (mount point, root of the mount)} of the v2 hierarchy and v1 memory one."""
    found: dict[int, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        after = fields.index("-")
        fstype, options = fields[after + 1], fields[after + 3].split(",")
        if fstype == "cgroup2":
            found.setdefault(2, (fields[4], fields[3]))
        elif fstype == "cgroup" and "memory" in options:
            found.setdefault(1, (fields[4], fields[3]))
    return found


def _usable(folder: Path, version: int) -> bool:
    if not os.access(folder, os.W_OK):
        return False
    if version == 1:
        return (folder / "memory.limit_in_bytes").exists()
    try:
        if "memory" not in (folder / "cgroup.controllers").read_text().split():
            return False
        if "memory" not in (folder / "cgroup.subtree_control").read_text().split():
            (folder / "cgroup.subtree_control").write_text("+memory")
    except OSError:  # e.g. EBUSY: processes in this group (cgroup v2's no-internal-process rule)
        return False
    return True


def _make(base: Group, name: str, memory_bytes: int) -> Group | None:
    group = Group(base.path / name, base.version)
    try:
        group.path.mkdir(exist_ok=True)
        if base.version == 2:
            settings = {"memory.max": memory_bytes, "memory.swap.max": 0, "memory.oom.group": 1}
        else:
            settings = {"memory.limit_in_bytes": memory_bytes,
                        "memory.memsw.limit_in_bytes": memory_bytes}  # fmt: skip
        for file, value in settings.items():
            if (group.path / file).exists():
                (group.path / file).write_text(str(value))
    except OSError as e:
        logger.warning("sandbox: cannot make the cgroup %s (%s); the run's memory is watched "
                       "by its pid 1 instead", group.path, e)  # fmt: skip
        _remove(group)
        return None
    atexit.register(_remove, group)
    return group


def _remove(group: Group) -> None:
    try:
        group.path.rmdir()
    except OSError:  # already gone, or a process of it still dying: the kernel keeps it
        pass
