"""The process that runs one program for `rlblocks.rewards.sandbox`: limits first, then the program.

Started by `Sandbox.run` as ``python -I sandbox_runner.py FOLDER`` in a new session (its own
process group), with stdin, stdout and stderr already redirected to files of FOLDER, and the
write end of the parent's report pipe open. FOLDER is the parent's private folder (root-only
when the parent is root): ``config`` (the limits, the uid, the report pipe's fd), ``program.py``,
``claims`` and, for an assert-style test, ``test``. Only the standard library is imported, and
three sibling files (`sandbox_fs`, `sandbox_syscalls`, `sandbox_check`): this file runs under
whatever interpreter the sandbox uses, with no rlblocks installed there.

Two channels back to the parent, so that the program cannot write what decides its reward:

- the **report pipe**, held by the runner, pid 1 and the checker but never by the program:
  which isolation held, a failed setup, the program's wait status, the whole run over its
  memory, the test's verdict;
- ``claims``, written by the program's process itself: how it says it ended (ran to its end,
  exit code, ``AssertionError``, ``MemoryError``, other exception). They only label an ending
  the wait status already gives; a program that lies about them only mislabels its failure.

The processes, so that every process the program starts dies with it:

    runner R (root or the caller's user, outside any namespace; session leader)
      unshare(new mount, network, pid and IPC namespaces; a user namespace when not root)
      └── init C: pid 1 of the new pid namespace. Builds the program's root (`sandbox_fs`),
          starts P (and Q), reaps every orphan, watches the run's memory where no cgroup
          does, reports P's wait status, exits: the kernel then kills every process left in
          the namespace (setsid or double fork included) and frees its SysV IPC objects.
          ├── program P: joins the run's cgroup, rlimits, the sandbox uid, no capabilities,
          │   no_new_privs, the seccomp filter (`sandbox_syscalls`), then exec's ``program.py``
          │   in-process (one interpreter start per run, not two); with a test, it then
          │   answers the checker's requests (`sandbox_check`).
          └── checker Q (assert-style tests only): forked before any program code ran, reads
              the test (P never did), drops privileges and runs it, asking P for the
              program's values; writes the verdict to the report pipe.

Where namespaces are refused (no root and no unprivileged user namespaces), R runs P itself in
its process group (the wall-clock kill of the group still applies) with the same limits and
filter, and an audit hook that refuses sockets and starting programs.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import resource
import signal
import sys


def _sibling(name: str):
    """Import a sibling file: its folder is on ``sys.path`` only meanwhile, so the program
    never imports from it (it holds a ``math.py``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        return importlib.import_module(name)
    finally:
        del sys.path[0]


sandbox_fs = _sibling("sandbox_fs")
sandbox_syscalls = _sibling("sandbox_syscalls")
sandbox_check = None  # imported for assert-style tests only: its ``ast`` costs ~5 ms a run

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x20000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
WORKDIR = "/tmp/sandbox"
CHECKER_UID_OFFSET = 2_000_000  # the checker's uid: past every program uid (sandbox.UID_BASE)
WATCH_SECONDS = 0.005  # how often pid 1 sums the run's memory where no cgroup bounds it
BLOCKED_EVENTS = {  # the fallback without a network namespace: no sockets, no other programs
    "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "ctypes.dlopen",
    "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function",
}  # fmt: skip

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def main(folder: str) -> None:
    """R: tie our life to the parent's, enter the namespaces, start C (or P directly)."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    cfg = _read_config(os.path.join(folder, "config"))
    if os.getppid() != cfg["parent"]:  # the parent died before PDEATHSIG was set
        os._exit(111)
    if cfg["test"]:
        global sandbox_check
        sandbox_check = _sibling("sandbox_check")
    with open(os.path.join(folder, "program.py")) as f:
        source = f.read()
    cfg["claims"] = os.open(os.path.join(folder, "claims"), os.O_WRONLY | os.O_APPEND)
    cfg["test_fd"] = None
    if cfg["test"]:  # opened, then unlinked: only its fd (the checker's) reaches it
        cfg["test_fd"] = os.open(os.path.join(folder, "test"), os.O_RDONLY)
        os.unlink(os.path.join(folder, "test"))
    cfg["cgroup_fd"] = os.open(cfg["cgroup"], os.O_WRONLY) if cfg["cgroup"] else None
    cfg["folders"] = sandbox_fs.interpreter_folders()
    isolation = cfg["isolation"] = _enter_namespaces() if cfg["namespaces"] else "none"
    _say(cfg, f"isolation {isolation}")
    if isolation == "none":  # no pid namespace to hold the program: run it here
        checker = _start_checker(cfg) if cfg["test"] else None
        _program(cfg, source, checker, audit=True)
    # The parent's deadline is a SIGTERM to us: kill the namespace's pid 1, then wait until
    # the kernel has killed everything in it. Both signals are taken in this loop, one at a
    # time, so the kill never reaches a pid that we already reaped (and that may be reused).
    waited = {signal.SIGTERM, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _init(cfg, source)
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        if signal.sigwaitinfo(waited).si_signo == signal.SIGTERM:
            os.kill(child, signal.SIGKILL)


def _read_config(path: str) -> dict:
    """``key value`` lines: integers, None, True, False or text. (Not json: importing it costs
    about 5 ms of a run's 50.)"""
    words = {"None": None, "True": True, "False": False}
    cfg = {}
    with open(path) as f:
        for line in f.read().splitlines():
            key, _, value = line.partition(" ")
            cfg[key] = words[value] if value in words else int(value) if value.isdigit() else value
    return cfg


def _enter_namespaces() -> str:
    """Unshare mount, network, pid and IPC namespaces (plus a user namespace when not root)."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
    if os.geteuid() == 0:
        return "namespaces" if libc.unshare(flags) == 0 else "none"
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(flags | CLONE_NEWUSER) != 0:
        return "none"
    # Map our own uid to root inside, so that C may mount; outside it is still just us.
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return "user-namespaces"


def _init(cfg: dict, source: str) -> None:
    """C, pid 1 of the new namespace: the program's root, P (and Q), then reap until they end."""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(PR_SET_DUMPABLE, 0)
        own_proc = sandbox_fs.build_root(cfg["tmp_bytes"], cfg["tmp_inodes"], cfg["folders"])
        # Without a cgroup, pid 1 sums the run's memory, from a /proc of the namespace only.
        cfg["watch"] = cfg["cgroup"] is None and own_proc
        os.mkdir(WORKDIR, 0o700)
        with open(os.path.join(WORKDIR, "program.py"), "w") as f:
            f.write(source)
        if cfg["uid"] is not None:
            for path in (WORKDIR, os.path.join(WORKDIR, "program.py")):
                os.chown(path, cfg["uid"], cfg["uid"])
        os.chdir(WORKDIR)
        checker = _start_checker(cfg) if cfg["test"] else None
    except BaseException as e:  # noqa: BLE001 -- reported to the parent as a sandbox error
        _say(cfg, f"setup {type(e).__name__}: {e}")
        os._exit(112)
    program = os.fork()
    if program == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.setpgid(0, 0)  # a group of its own: killpg(0) from the program cannot reach pid 1
        _program(cfg, source, checker, audit=False)
    if checker:
        for fd in checker[1:]:
            os.close(fd)
    status = _reap(cfg, program, checker[0] if checker else None)
    _say(cfg, f"status {status}")
    os._exit(0)  # the kernel now SIGKILLs whatever P left running in the namespace


def _start_checker(cfg: dict) -> tuple[int, int, int]:
    """Fork Q before any program code runs; (Q's pid, P's request fd, P's reply fd)."""
    requests_in, requests_out = os.pipe()  # Q writes requests, P reads them
    replies_in, replies_out = os.pipe()  # P writes replies, Q reads them
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.close(requests_in)
        os.close(replies_out)
        _checker(cfg, requests_out, replies_in)
    os.close(requests_out)
    os.close(replies_in)
    os.close(cfg.pop("test_fd"))  # Q has it; P must never hold it
    return pid, requests_in, replies_out


def _checker(cfg: dict, requests: int, replies: int) -> None:
    """Q: read the test, give up every privilege, run the test against P, report the verdict."""
    try:
        with os.fdopen(cfg["test_fd"]) as f:  # a nonce the parent checks, then the test
            nonce, _, test = f.read().partition("\n")
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        for fd in (cfg["claims"], cfg["cgroup_fd"]):
            if fd is not None:
                os.close(fd)
        uid = None if cfg["uid"] is None else cfg["uid"] + CHECKER_UID_OFFSET
        _confine(cfg, uid, processes=1 if uid is not None else None)
    except BaseException as e:  # noqa: BLE001 -- the sandbox could not be set up
        _say(cfg, f"setup checker {type(e).__name__}: {e}")
        os._exit(112)
    assert sandbox_check is not None  # main() imported it: the run has a test
    link = sandbox_check.Link(requests, replies, cfg["file_bytes"])
    _say(cfg, f"check {nonce} {sandbox_check.check(test, link)}")
    os._exit(0)


def _reap(cfg: dict, program: int, checker: int | None) -> int:
    """Reap every orphan of the namespace until P (and Q) ended; P's wait status. Where no
    cgroup bounds the run (``watch``), sum its memory (every process but this one and Q) every
    `WATCH_SECONDS` and end the run past ``memory_bytes``."""
    status, left = None, {program} | ({checker} if checker else set())
    while left:
        while True:
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            left.discard(pid)
            status = code if pid == program else status
        if not left:
            break
        if cfg["watch"]:
            held = _memory_held({1, checker})
            if held > cfg["memory_bytes"]:
                _say(cfg, f"memory pid 1's watch: {held} bytes resident")
                os._exit(0)  # the kernel kills the rest
        signal.sigtimedwait({signal.SIGCHLD}, WATCH_SECONDS if cfg["watch"] else 1.0)
    assert status is not None  # P was reaped
    return status


def _memory_held(skip: set) -> int:
    """Bytes of anonymous and shared memory resident in the namespace's processes but
    ``skip`` (RssAnon + RssShmem of /proc/PID/status; a page shared after fork counts once
    per process that maps it)."""
    total = 0
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in skip:
            try:
                with open(f"/proc/{name}/status", "rb") as f:
                    text = f.read()
            except OSError:  # exited meanwhile
                continue
            for key in (b"RssAnon:", b"RssShmem:"):
                at = text.find(key)
                if at >= 0:
                    total += int(text[at + len(key) :].split(None, 1)[0]) * 1024
    return total


def _confine(cfg: dict, uid: int | None, processes: int | None) -> None:
    """Rlimits, then ``uid`` (or, in a user namespace, no capabilities), no_new_privs, not
    dumpable, and the seccomp filter: what no code of the sandboxed process can undo."""
    limits = {
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_CPU: cfg["cpu_seconds"],
        resource.RLIMIT_AS: cfg["memory_bytes"],
        resource.RLIMIT_FSIZE: cfg["file_bytes"],
        resource.RLIMIT_NOFILE: cfg["open_files"],
        # In a user namespace R, C and Q share the program's count.
        resource.RLIMIT_NPROC: processes or cfg["processes"] + _helpers(cfg),
    }
    for which, value in limits.items():
        # CPU: the soft limit sends SIGXCPU, the hard limit one second later SIGKILL.
        hard = value + 1 if which == resource.RLIMIT_CPU else value
        resource.setrlimit(which, (value, hard))
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a new uid cleared it
    elif cfg["isolation"] == "user-namespaces":
        sandbox_syscalls.drop_capabilities(libc)
    if os.getuid() == 0 and _initial_user_namespace():
        # The kernel never applies RLIMIT_NPROC to root: a fork bomb would be unbounded.
        raise PermissionError("still root in the initial user namespace: no process limit")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    libc.prctl(PR_SET_DUMPABLE, 0)  # no /proc/PID/mem, fd or ptrace access by the same uid
    if cfg["seccomp"]:
        sandbox_syscalls.load_filter()


def _helpers(cfg: dict) -> int:
    """Processes of the run that share the program's uid in a user namespace: R, C and Q."""
    return (2 + bool(cfg["test"])) * (cfg["isolation"] == "user-namespaces")


def _program(cfg: dict, source: str, checker: tuple | None, *, audit: bool) -> None:
    """P: limits and identity that the program cannot undo, then the program itself."""
    try:
        if cfg["cgroup_fd"] is not None:
            os.write(cfg["cgroup_fd"], b"0")  # into the run's cgroup, with what it starts
            os.close(cfg["cgroup_fd"])
        _confine(cfg, cfg["uid"], None)
        if audit:
            os.chdir(cfg["workdir"])
    except BaseException as e:  # noqa: BLE001 -- the sandbox could not be set up
        _say(cfg, f"setup {type(e).__name__}: {e}")
        os._exit(112)
    os.close(cfg["report"])  # the program must never hold the report pipe
    if audit:
        sys.addaudithook(_refuse_network)
    sys.argv, sys.path[0:0] = ["program.py"], [os.getcwd()]
    scope = {"__name__": "__main__", "__file__": "program.py", "__builtins__": __builtins__}
    try:
        code = compile(source, "program.py", "exec")  # a SyntaxError is the program's error
        exec(code, scope)  # noqa: S102
        if checker:
            assert sandbox_check is not None  # main() imported it: the run has a test
            sandbox_check.serve(scope, checker[1], checker[2], cfg["file_bytes"])
        line, exit_code = "done", 0
    except SystemExit as e:
        exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        line = f"exit {exit_code}"
    except MemoryError:
        line, exit_code = "memory", 1
        scope.clear()  # the program's objects go: memory back to report it
        _print_traceback()
    except AssertionError:
        _print_traceback()
        line, exit_code = "assertion", 1
    except BaseException as e:  # noqa: BLE001 -- whatever the program raised ends it
        _print_traceback()
        line, exit_code = f"error {type(e).__name__}", 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001, S110 -- e.g. EFBIG past the file-size limit
            pass
    _claim(cfg, line)
    os._exit(exit_code & 0xFF)


def _print_traceback() -> None:
    """The current exception's traceback on stderr. Imported here: ``traceback`` costs about
    10 ms of a run (it imports ``re`` and ``tokenize``), and a passing program never needs it."""
    try:
        import traceback

        traceback.print_exc()
    except Exception:  # noqa: BLE001, S110 -- best effort: the claim must still be made
        # Short of memory, CPython may raise MemoryError here, or SystemError ("error return
        # without exception set") from deep inside an import; neither may cost the claim.
        pass


def _initial_user_namespace() -> bool:
    """Whether this process is in the initial user namespace (its uid map is the identity)."""
    with open("/proc/self/uid_map") as f:
        return f.read().split() == ["0", "0", "4294967295"]


def _refuse_network(event: str, args: tuple) -> None:
    if event in BLOCKED_EVENTS:
        raise PermissionError(f"sandbox: {event} is not allowed")


def _say(cfg: dict, line: str) -> None:
    """A line on the report pipe (R, C and Q only)."""
    try:
        os.write(cfg["report"], (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _claim(cfg: dict, line: str) -> None:
    """A line of the program's own account of its end (P only)."""
    try:
        os.write(cfg["claims"], f"{line}\n".encode("utf-8", "replace"))
    except OSError:
        pass


if __name__ == "__main__":
    main(sys.argv[1])
