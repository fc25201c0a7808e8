"""The system calls a sandboxed process may not make: a seccomp filter, and no capabilities.

Loaded by `sandbox_runner` (standard library only: it runs under the sandbox's interpreter,
without rlblocks' dependencies) and applied to the program's process and to the test checker,
after their limits and before any code of theirs runs. The filter is built with libseccomp
(``libseccomp.so.2``, through ``ctypes``): it knows each architecture's call numbers and
argument layout, and refuses the other ABIs of the machine (x32, i386 on x86_64), which a
hand-assembled BPF program would have to get right on its own. A Python binding from the
package index cannot be used: the runner's interpreter is often the system's, without them.

Allowed by default, refused with ``EPERM`` (the call fails, the program goes on):

- ``socket``/``socketpair`` of every family but ``AF_UNIX``: no IP, netlink, packet, vsock,
  Bluetooth or kernel-crypto sockets, even inside the empty network namespace;
- ``io_uring_*``: its operations (connect, socket, open) would bypass this filter;
- new namespaces: ``unshare``, ``setns``, and ``clone`` with a ``CLONE_NEW*`` flag
  (``clone3``, whose flags seccomp cannot read, answers ``ENOSYS`` so that libc falls back
  to ``clone``);
- other processes' memory: ``ptrace``, ``process_vm_readv``/``writev``;
- the kernel's own state: ``mount`` and the new mount API, ``pivot_root``, ``chroot``,
  ``keyctl``/``add_key``/``request_key``, ``bpf``, ``perf_event_open``, ``userfaultfd``,
  module loading, ``kexec``, ``reboot``, swap, clocks, host names, ``syslog``, ``acct``,
  ``quotactl``, ``iopl``/``ioperm``, file handles (``open_by_handle_at``);
- ``personality`` except the query (``0xffffffff``): no turning address randomisation off;
- memory outside every per-process limit: SysV IPC (``shm*``, ``sem*``, ``msg*``), POSIX
  message queues (``mq_*``) and ``memfd_create`` (anonymous files no folder's size bounds).
"""

from __future__ import annotations

import ctypes
import errno

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7
AF_UNIX = 1
PERSONALITY_QUERY = 0xFFFFFFFF
NAMESPACE_FLAGS = (  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
    0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
)  # fmt: skip
REFUSED = (
    "io_uring_setup", "io_uring_enter", "io_uring_register", "unshare", "setns",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "mount", "umount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
    "swapon", "swapoff", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "sethostname", "setdomainname", "syslog", "acct", "quotactl", "quotactl_fd", "iopl",
    "ioperm", "lookup_dcookie", "vhangup", "uselib", "fanotify_init",
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend",
    "mq_timedreceive", "mq_notify", "mq_getsetattr", "memfd_create", "memfd_secret",
)  # fmt: skip
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
CAP_VERSION_3 = 0x20080522


class _ArgCmp(ctypes.Structure):
    """libseccomp's ``struct scmp_arg_cmp``: argument ``arg`` ``op`` ``datum_a`` (``datum_b``)."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


def load_filter() -> None:
    """Install the filter on this process (and every process it starts); raises ``OSError``
    naming what failed, libseccomp missing included."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as e:
        raise OSError(
            errno.ENOENT, f"libseccomp.so.2 cannot be loaded ({e}); install libseccomp2 or "
            "pass Sandbox(seccomp=False)",
        ) from None  # fmt: skip
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    ]  # fmt: skip
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    try:
        for name, action, cmps in _rules():
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # not a call of this architecture
                continue
            array = (_ArgCmp * max(len(cmps), 1))(*[_ArgCmp(*c) for c in cmps])
            rc = lib.seccomp_rule_add_array(ctx, action, number, len(cmps), array)
            if rc < 0:
                raise OSError(-rc, f"seccomp rule for {name}: {errno.errorcode.get(-rc, rc)}")
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise OSError(-rc, f"seccomp_load: {errno.errorcode.get(-rc, rc)}")
    finally:
        lib.seccomp_release(ctx)


def _rules() -> list[tuple[str, int, list[tuple[int, int, int, int]]]]:
    """(call, action, argument comparisons): a call is refused when all its comparisons hold;
    several rules for one call refuse it when any holds."""
    refuse = _errno_action(errno.EPERM)
    rules: list[tuple[str, int, list[tuple[int, int, int, int]]]]
    rules = [(name, refuse, []) for name in REFUSED]
    rules += [(name, refuse, [(0, SCMP_CMP_NE, AF_UNIX, 0)]) for name in ("socket", "socketpair")]
    rules += [("clone", refuse, [(0, SCMP_CMP_MASKED_EQ, flag, flag)]) for flag in NAMESPACE_FLAGS]
    rules.append(("clone3", _errno_action(errno.ENOSYS), []))
    rules.append(("personality", refuse, [(0, SCMP_CMP_NE, PERSONALITY_QUERY, 0)]))
    return rules


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities(libc: ctypes.CDLL) -> None:
    """No capabilities, now or after an ``execve``: for a process that is root inside a user
    namespace (as root outside, changing to another uid already drops them all)."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # EINVAL past the last capability
        cap += 1
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if libc.capset(ctypes.byref(_CapHeader(CAP_VERSION_3, 0)), (_CapData * 2)()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"capset: {errno.errorcode.get(code, code)}")
