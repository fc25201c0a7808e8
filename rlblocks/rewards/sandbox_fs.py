"""The files a sandboxed program sees: a new root that holds what Python needs, and no more.

Built by the namespace's pid 1 (`sandbox_runner`), root of a fresh mount namespace, before the
program starts; standard library only (it runs under the sandbox's interpreter). The new root
is a small tmpfs, read-only once built, holding:

- read-only bind mounts of the system folders a Python program needs (`SYSTEM`: /usr, /bin,
  /sbin, /lib*, /etc; top-level symlinks, as in a merged /usr, are copied as symlinks) and of
  the interpreter's own folders where they lie elsewhere (its prefixes and ``sys.path``);
- /dev with null, zero, full, random and urandom bound from the host, and the fd links;
- /proc of the new pid namespace (the host's, where the system refuses a new one);
- private tmpfs folders (`PRIVATE_TMP`), ``tmp_bytes`` and ``tmp_inodes`` each.

Nothing else of the host is there: not /run (/var/run), /var, /home, /root, /srv, /mnt, /opt,
/sys, the caller's project or temporary folders. So no Unix socket of the host can be reached
by path unless it lies inside one of the bound folders (``find /usr /bin /sbin /lib* /etc
-type s`` lists none on this project's machines), and none by abstract name (abstract names belong to the network namespace; the program's has none).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 0x4000, 0x40000
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
MNT_DETACH = 2
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}  # fmt: skip
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # the usual world-writable folders
NEW = "/tmp"  # where the new root is built (in this mount namespace only) before pivot_root
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:  # fmt: skip
    args = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if libc.mount(args[0], args[1], args[2], flags, args[3]) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {source} on {target}: {os.strerror(code)}")


def interpreter_folders() -> list[str]:
    """The real paths of this interpreter's prefixes and ``sys.path`` folders (a zip file on
    ``sys.path`` counts as its folder): what the program needs to import the standard library
    and the interpreter's packages."""
    found = []
    for path in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path):
        real = os.path.realpath(path) if path else ""
        if real and os.path.exists(real):
            found.append(real if os.path.isdir(real) else os.path.dirname(real))
    return found


def build_root(tmp_bytes: int, tmp_inodes: int, folders: list[str]) -> bool:
    """Make the new root and move into it (see the module docstring); whether its /proc is
    the pid namespace's own. Needs the mount namespace's root and the host's /proc on /proc;
    raises ``OSError`` naming the step."""
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    binds, links = _plan(folders)
    # O_PATH handles first: the new root is mounted over /tmp, which may hold some of them.
    handles = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in binds}
    handles |= {f"/dev/{d}": os.open(f"/dev/{d}", os.O_PATH | os.O_CLOEXEC)
                for d in DEVICES if os.path.exists(f"/dev/{d}")}  # fmt: skip
    try:
        _mount("tmpfs", NEW, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=755")
        for path, target in links.items():
            os.symlink(target, NEW + path)
        for path, fd in handles.items():
            _bind(f"/proc/self/fd/{fd}", path, device=path.startswith("/dev/"))
    finally:
        for fd in handles.values():
            os.close(fd)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{NEW}/dev/{name}")
    tmp = f"size={tmp_bytes},nr_inodes={tmp_inodes},mode=1777"
    for path in PRIVATE_TMP:
        os.makedirs(NEW + path, 0o755, exist_ok=True)
        _mount("tmpfs", NEW + path, "tmpfs", MS_NOSUID | MS_NODEV, tmp)
    os.symlink("/run", NEW + "/var/run")
    own_proc = _mount_proc()
    os.mkdir(NEW + "/.old")
    _pivot_root(NEW, NEW + "/.old")
    os.chdir("/")
    if libc.umount2(b"/.old", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "umount the old root")
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return own_proc


def _plan(folders: list[str]) -> tuple[list[str], dict[str, str]]:
    """(folders to bind, top-level symlinks to copy): `SYSTEM`'s, then each of ``folders``
    not already inside one bound (compared by real path)."""
    binds, links = [], {}
    for path in SYSTEM:
        if os.path.islink(path):
            links[path] = os.readlink(path)
        elif os.path.isdir(path):
            binds.append(path)
    covered = [os.path.realpath(p) for p in [*binds, *links]]
    for path in folders:
        if not any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered):
            binds.append(path)
            covered.append(path)
    return binds, links


def _bind(source: str, path: str, *, device: bool) -> None:
    """Bind ``source`` (a /proc/self/fd link to ``path``) at ``path`` in the new root:
    read-only, without setuid (devices stay writable and usable)."""
    target = NEW + path
    if device:
        os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
        open(target, "w").close()
        _mount(source, target, None, MS_BIND)
        return
    os.makedirs(target, 0o755, exist_ok=True)
    _mount(source, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | _kept_flags(target))


def _kept_flags(path: str) -> int:
    """The flags a remount must keep: in a user namespace, the kernel refuses a remount that
    would clear ``noexec`` or change the atime setting of a mount it copied from the host."""
    have = os.statvfs(path).f_flag
    flags = MS_NOSUID | MS_NODEV
    pairs = ((os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME),
             (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))  # fmt: skip
    for st, ms in pairs:
        if have & st:
            flags |= ms
    if not have & (os.ST_NOATIME | os.ST_RELATIME):
        flags |= MS_STRICTATIME
    return flags


def _mount_proc() -> bool:
    """A /proc of the new pid namespace (True); where the system refuses one (some
    containers), the host's (False: its processes are listed, but none can be signalled)."""
    os.mkdir(NEW + "/proc")
    try:
        _mount("proc", NEW + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        _mount("/proc", NEW + "/proc", None, MS_BIND | MS_REC)
        return False
    return True


def _pivot_root(new: str, old: str) -> None:
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: no call number known for {os.uname().machine}")
    if libc.syscall(number, new.encode(), old.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"pivot_root: {os.strerror(code)}")
