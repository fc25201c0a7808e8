"""`Sandbox`: run an untrusted Python program under limits, in a root of its own, with no network.

Each `Sandbox.run` starts one process (`sandbox_runner`) in a new session, so the program and
everything it starts form a process group of their own, and waits for it under a wall-clock
deadline; at the deadline the whole group gets SIGKILL. What holds the program, on Linux:

========================  ==================================================================
limit                     how
========================  ==================================================================
CPU time                  ``RLIMIT_CPU`` (SIGXCPU at the limit, SIGKILL one second later)
memory, per process       ``RLIMIT_AS``: all virtual memory, so ``mmap`` and thread stacks
                          count too; the price: runtimes that reserve address space up front
                          (Go, JVM, ASan) need a larger limit than they really use
memory, the whole run     a memory cgroup per sandbox slot (v2, else v1) where this process
                          may make one (`sandbox_cgroup`); else pid 1 of the run sums its
                          processes' resident memory every 5 ms and ends the run past it
processes                 ``RLIMIT_NPROC``, per user, threads included; root is exempt from
                          it, so a root parent runs each program as a uid of its own (below)
file size                 ``RLIMIT_FSIZE``: stdout, stderr and every file the program writes
open files                ``RLIMIT_NOFILE``
wall clock                the parent kills the process group at ``wall_seconds``
leftover processes        a new pid namespace: its pid 1 waits for the program and exits
                          with it, and the kernel kills every process left in the namespace,
                          even those that left the process group (``setsid``, double fork)
SysV IPC                  a new IPC namespace (its objects die with the run) and the
                          seccomp filter refuses the calls outright
network                   a new network namespace: no interface but a loopback that is down,
                          and no abstract Unix socket of the host; the seccomp filter refuses
                          sockets of every family but ``AF_UNIX``
files                     a new root (`sandbox_fs`): the system's folders read-only, fresh
                          tmpfs folders (/tmp, /var/tmp, /dev/shm, /run/lock; ``tmp_bytes``
                          and ``tmp_inodes`` each), nothing else of the host: no /run, /home,
                          project or temporary folder, no Unix socket of the host
system calls              a seccomp filter (`sandbox_syscalls`): no new namespaces, ptrace,
                          mount, keyctl, bpf, io_uring, personality changes, ...
files outside             as root: the program runs as uid ``UID_BASE + slot`` (no such user,
                          no groups, ``no_new_privs``), so it reads only what any user may
                          read of the system's folders and writes only its tmpfs folders; it
                          cannot signal the caller's processes
========================  ==================================================================

Namespaces need root or unprivileged user namespaces. As a non-root user with user namespaces
the program keeps the caller's uid outside (and no capabilities inside). With neither, or
``namespaces=False``, there is no pid, mount, IPC or network namespace: the process-group
kill, the limits and the seccomp filter still apply, and an audit hook in the program refuses
sockets and starting other programs. `RunResult.isolation` says which held.

An assert-style test (``run(program, test=...)``) runs in a checker process that never holds
a program object (`sandbox_check`); its verdict is `RunResult.check`.

Why not `ProcessPool`: each program already is a process killed at its deadline; a pool worker
around it would add a process and a pipe hop per run, and `per_sample` reduces a row to one
float, while this reward reports each program's outcome. The runner is started without
``preexec_fn`` (fork and exec in C), so starting it from a threaded training process is safe.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlblocks.rewards.sandbox_cgroup import pid_gone, slot_group

logger = logging.getLogger(__name__)

RUNNER = Path(__file__).with_name("sandbox_runner.py")
UID_BASE = 2_000_000_000  # far above real users and the usual subordinate-id ranges
SLOTS = 100  # programs one process runs at once, each with its own uid
STOP_SECONDS = 5.0  # how long a stopped run may take to die before the caller warns
MiB = 1 << 20
OUTCOMES = ("ok", "assertion", "error", "timeout", "memory", "crashed", "output", "sandbox_error")
"""How a run ended: ran to its end (or exit 0); an ``assert`` failed; another exception or a
non-zero exit; past its CPU or wall time; out of memory (``MemoryError`` in a process, or the
whole run past ``memory_bytes``); killed by a signal; stdout past ``output_bytes``; the
sandbox itself failed (a bug or a refused setup, not the program's fault)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use. Every field is per run."""

    cpu_seconds: int = 5
    """CPU seconds (``RLIMIT_CPU``), per process."""
    wall_seconds: float = 10.0
    """Wall-clock seconds before the whole process group is killed."""
    memory_bytes: int = 512 * MiB
    """Address space of each process (``RLIMIT_AS``), and memory of the whole run together:
    its processes and the files of its tmpfs folders (a cgroup), or its processes' resident
    memory (pid 1's watch, where no cgroup can be made)."""
    processes: int = 32
    """Processes and threads of the program's uid (``RLIMIT_NPROC``), the program included."""
    file_bytes: int = 16 * MiB
    """Largest file the program may write (``RLIMIT_FSIZE``), stdout and stderr included."""
    output_bytes: int = 1 * MiB
    """Stdout beyond this is the outcome ``output``; this much is read back."""
    open_files: int = 64
    """File descriptors (``RLIMIT_NOFILE``)."""
    tmp_bytes: int = 64 * MiB
    """Size of each private tmpfs (/tmp with the program's folder, /var/tmp, /dev/shm, /run/lock)."""
    tmp_inodes: int = 4096
    """Files and folders each private tmpfs may hold (``nr_inodes``)."""


@dataclass(frozen=True)
class RunResult:
    """One program run: how it ended, its output, and which isolation held."""

    outcome: str
    """One of `OUTCOMES`."""
    stdout: str
    stderr: str
    finished: bool
    """The program ran to its last line (no exit, no exception), as its own process says: a
    hostile program can claim it, so no reward is decided by it (assert tests use `check`)."""
    seconds: float
    isolation: str
    """"namespaces" (root), "user-namespaces" (not root), "none" (the audit-hook fallback)."""
    detail: str = ""
    """The exit code, signal or exception type, or what failed in the sandbox."""
    check: str = ""
    """With a ``test``: the checker's verdict, ``passed``, ``failed REASON`` (an assertion, or
    the program ended before answering) or ``error TYPE: MESSAGE``; "" without one."""


_slots: queue.SimpleQueue[int] = queue.SimpleQueue()  # process-wide: uids must not be shared
for _slot in range(SLOTS):
    _slots.put(_slot)


@dataclass(frozen=True)
class Sandbox:
    """Runs programs under `SandboxLimits`; ``workers`` at once in `run_many`.

    ``python``: the interpreter of the programs; default: this one, if the sandbox uid can run
    it, else ``python3`` on the PATH (a root parent's interpreter under /root, mode 700, cannot
    be run by any other uid). ``namespaces=False`` skips the namespaces (the weak fallback of
    the module docstring), for testing it or for systems that log refused ``unshare`` calls.
    ``seccomp=False`` skips the seccomp filter (for a system without libseccomp, or to see
    what the namespaces hold alone); ``cgroups=False`` bounds the run's memory by pid 1's
    watch even where a cgroup could be made.
    """

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    workers: int = 2
    python: str | None = None
    namespaces: bool = True
    seccomp: bool = True
    cgroups: bool = True

    def __post_init__(self) -> None:
        if self.workers < 1 or self.workers > SLOTS:
            raise ValueError(
                f"Sandbox: workers must be in 1..{SLOTS}, got {self.workers}; pass a count in "
                "that range"
            )
        if self.python is None:
            object.__setattr__(self, "python", _default_python())

    def run(self, program: str, stdin: str = "", *, test: str | None = None) -> RunResult:
        """Run ``program`` (Python source) once with ``stdin``; never raises for the program.

        ``test``: Python code (asserts) run after the program, in a checker process that
        asks the program for its values as plain data (`sandbox_check`); its verdict is
        `RunResult.check`.
        """
        slot = _slots.get()
        try:
            return _run(self, program, stdin, test, slot)
        finally:
            _slots.put(slot)

    def run_many(self, jobs: Iterable[tuple[str, str]]) -> list[RunResult]:
        """`run` each ``(program, stdin)``, ``workers`` at a time; results in order."""
        return run_each(self.run, jobs, self.workers)


def run_each(
    run: Callable[[str, str], RunResult], jobs: Iterable[tuple[str, str]], workers: int
) -> list[RunResult]:
    """``run(program, stdin)`` for each job, ``workers`` threads at a time; results in order
    (a sandbox's ``run_many``)."""
    jobs = list(jobs)
    if len(jobs) <= 1 or workers == 1:
        return [run(p, s) for p, s in jobs]
    with ThreadPoolExecutor(workers, thread_name_prefix="rlblocks-sandbox") as ex:
        return list(ex.map(lambda job: run(*job), jobs))


def _default_python() -> str:
    if os.geteuid() != 0 or _others_can_run(sys.executable):
        return sys.executable
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        found = os.path.join(folder, "python3")
        if os.path.isfile(found) and _others_can_run(found):
            logger.info("sandbox: programs run with %s (other uids cannot run %s)",
                        found, sys.executable)  # fmt: skip
            return found
    raise RuntimeError(
        f"Sandbox: the sandbox uid cannot run {sys.executable} (a folder on its path is not "
        "searchable by other users) and no python3 on the PATH is; pass python=..."
    )


def _others_can_run(path: str) -> bool:
    """Every folder above ``path`` is searchable, and ``path`` readable and executable, by all."""
    real = Path(os.path.realpath(path))
    dirs_ok = all(p.stat().st_mode & 0o001 for p in real.parents)
    return dirs_ok and real.stat().st_mode & 0o005 == 0o005


def _run(box: Sandbox, program: str, stdin: str, test: str | None, slot: int) -> RunResult:
    limits, root = box.limits, os.geteuid() == 0
    uid = UID_BASE + (os.getpid() % 20_000) * SLOTS + slot if root else None
    sweep_stale_folders(tempfile.gettempdir())
    group = slot_group(slot, limits.memory_bytes) if box.cgroups else None
    me = os.getpid()  # in the names: a later process removes them if this one was killed
    folder = Path(tempfile.mkdtemp(prefix=f"rlblocks-sandbox-{me}-"))  # mode 700: ours only
    # The folder of a run without namespaces (asked for, or refused by the system): on disk,
    # the sandbox uid's own. With namespaces, /tmp/sandbox on a tmpfs hides it.
    work = Path(tempfile.mkdtemp(prefix=f"rlblocks-sandbox-work-{me}-"))
    report = _Report()
    try:
        if uid is not None:
            os.chown(work, uid, uid)
        cfg = asdict(limits) | {
            "parent": os.getpid(), "uid": uid, "namespaces": box.namespaces, "workdir": str(work),
            "report": report.write_end, "test": test is not None, "seccomp": box.seccomp,
            "cgroup": group.procs if group else None,
        }  # fmt: skip
        (folder / "config").write_text("".join(f"{k} {v}\n" for k, v in cfg.items()))
        (folder / "program.py").write_text(program)
        (folder / "stdin").write_text(stdin)
        (folder / "claims").touch(mode=0o600)
        nonce = secrets.token_hex(16)  # only the checker reads it: its verdict line bears it
        if test is not None:
            (folder / "test").write_text(f"{nonce}\n{test}")
        ooms = group.oom_kills() if group else 0
        start = time.monotonic()
        timed_out, returncode = _start_and_wait(box, folder, report, limits.wall_seconds)
        seconds = time.monotonic() - start
        if group and group.oom_kills() > ooms:
            report.lines.append(f"memory cgroup v{group.version}: OOM kill")
        return _judge(folder, report, nonce, limits, timed_out, returncode, seconds)
    finally:
        report.close()
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


class _Report:
    """The read end of the runner's report pipe, and the lines read from it so far."""

    def __init__(self) -> None:
        self.read_end, self.write_end = os.pipe()
        os.set_blocking(self.read_end, False)
        self.lines: list[str] = []
        self._rest = b""

    def said(self) -> dict[str, str]:
        """What the runner, pid 1 and the checker reported, by first word (the first wins)."""
        while True:
            try:
                chunk = os.read(self.read_end, 65536)
            except BlockingIOError:  # a writer is still alive and has said nothing more
                break
            if not chunk:
                break
            *whole, self._rest = (self._rest + chunk).split(b"\n")
            self.lines += [line.decode("utf-8", "replace") for line in whole]
        said: dict[str, str] = {}
        for line in self.lines:
            word, _, rest = line.partition(" ")
            said.setdefault(word, rest)
        return said

    def close(self) -> None:
        for fd in (self.read_end, self.write_end):
            if fd >= 0:
                os.close(fd)
        self.read_end = self.write_end = -1


STALE = re.compile(r"rlblocks-sandbox-(?:work-)?(\d+)-")
_swept: set[str] = set()


def sweep_stale_folders(root: str) -> None:
    """Remove, once per process and folder, the run folders in ``root`` that a process left
    when it was killed before its ``finally`` ran (SIGKILL, a lost node): those named after a
    process id that no longer runs, and owned by this user (or, for root, by a sandbox uid:
    `_run` gives the work folder to it). A folder of a live process is never
    touched (a reused pid keeps it until that process ends too)."""
    if root in _swept:
        return
    _swept.add(root)
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        found = STALE.match(entry.name)
        if not found or not pid_gone(int(found[1])):
            continue
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
            ours = owner == os.geteuid() or (os.geteuid() == 0 and _sandbox_uid(owner))
            if entry.is_dir(follow_symlinks=False) and ours:
                shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:
            continue


def _sandbox_uid(uid: int) -> bool:
    """Whether ``uid`` is one a root caller gives its runs (a work folder chowned to it)."""
    return UID_BASE <= uid < UID_BASE + 20_000 * SLOTS


def _start_and_wait(box: Sandbox, folder: Path, report: _Report, wall: float) -> tuple[bool, int]:
    """Start the runner in its own session and wait for it, stopping it at ``wall`` s.

    Returns (stopped at the deadline, the runner's return code). Once this returns, no process
    of the run is alive: with namespaces the runner exits only after the namespace is empty;
    without, its process group is killed and waited for.
    """
    assert box.python is not None  # Sandbox.__post_init__ sets it
    with (
        open(folder / "stdin", "rb") as stdin,
        open(folder / "stdout", "wb") as stdout,
        open(folder / "stderr", "wb") as stderr,
    ):
        try:
            proc = subprocess.Popen(
                [box.python, "-I", str(RUNNER), str(folder)],
                stdin=stdin, stdout=stdout, stderr=stderr, cwd="/", pass_fds=(report.write_end,),
                start_new_session=True, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )  # fmt: skip
        finally:  # the runner holds it now: the pipe ends when the run's processes do
            os.close(report.write_end)
            report.write_end = -1
    timed_out = False
    try:
        if not _wait(proc, wall):
            timed_out = True
            if report.said().get("isolation", "none") != "none":
                proc.send_signal(signal.SIGTERM)  # the runner kills the namespace, waits for it
                if not _wait(proc, STOP_SECONDS):
                    logger.warning("sandbox: the runner did not stop in %g s; killed", STOP_SECONDS)
    finally:  # Ctrl-C in the caller included: the program must not outlive the call
        _kill_group(proc)
    return timed_out, proc.returncode


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``proc`` to end (and reap it); False if it still runs.

    Through a pidfd where the system has one: ``Popen.wait(timeout=...)`` polls with sleeps
    that grow to 50 ms, which cost about 25 ms of a 75 ms run (measured).
    """
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux 5.3+: poll
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        ended = bool(poller.poll(timeout * 1000))
    finally:
        os.close(pidfd)
    if ended:
        proc.wait()
    return ended


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the runner's process group, reap the runner, wait until the group is empty."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the usual end: the runner was reaped and nothing is left
        proc.wait()
        return
    proc.wait()  # reaped after the kill, so its pid (the group id) was not reused before it
    deadline = time.monotonic() + STOP_SECONDS
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.001)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive (not a zombie), read from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            return True
    return False


def _claims(folder: Path) -> dict[str, str]:
    """The program's own account of its end, by first word (the first wins). Written by the
    program's process, so only ever used to label an end, never to score it."""
    said: dict[str, str] = {}
    with open(folder / "claims", "rb") as f:
        for line in f.read(64 * 1024).decode("utf-8", "replace").splitlines():
            word, _, rest = line.partition(" ")
            said.setdefault(word, rest)
    return said


def _judge(
    folder: Path, report: _Report, nonce: str, limits: SandboxLimits, timed_out: bool,
    returncode: int, seconds: float,
) -> RunResult:  # fmt: skip
    """The `RunResult` from the report pipe and the files the run left in ``folder``. The
    checker's verdict counts only with the nonce that it alone read: where the program shares
    the caller's uid without namespaces, it could reach the report pipe through /proc."""
    with open(folder / "stdout", "rb") as f:
        out = f.read(limits.output_bytes + 1)
    with open(folder / "stderr", "rb") as f:
        err = f.read(64 * 1024).decode("utf-8", "replace")
    said, claims = report.said(), _claims(folder)
    isolation = said.get("isolation", "unknown")
    signed = f"check {nonce} "
    check = next((line[len(signed) :] for line in report.lines if line.startswith(signed)), "")

    def result(outcome: str, detail: str = "") -> RunResult:
        text = out[: limits.output_bytes].decode("utf-8", "replace")
        return RunResult(outcome, text, err, "done" in claims, seconds, isolation, detail, check)

    if "setup" in said:
        return result("sandbox_error", said["setup"])
    if "memory" in said:
        return result(
            "memory", f"the whole run over {limits.memory_bytes} bytes ({said['memory']})"
        )
    if timed_out:
        return result("timeout", f"wall clock {limits.wall_seconds:g} s")
    if len(out) > limits.output_bytes:
        return result("output", f"stdout over {limits.output_bytes} bytes")
    if "status" not in said and isolation != "none":
        return result("sandbox_error", f"the runner ended without a status; stderr: {err[-500:]}")
    # How the program's process ended: the status its pid 1 saw, or (fallback) the runner's.
    code = os.waitstatus_to_exitcode(int(said["status"])) if "status" in said else returncode
    if code < 0:
        sig = -code
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and seconds >= limits.cpu_seconds):
            return result(
                "timeout", f"CPU time {limits.cpu_seconds} s ({signal.Signals(sig).name})"
            )
        if sig == signal.SIGXFSZ:
            return result("output", "file size limit (SIGXFSZ)")
        return result("crashed", signal.Signals(sig).name)
    if "memory" in claims:
        return result("memory", "MemoryError")
    if "assertion" in claims:
        return result("assertion", "AssertionError")
    if "error" in claims:
        return result("error", claims["error"])
    return result("ok") if code == 0 else result("error", f"exit {code}")
