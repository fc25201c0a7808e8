"""The process that runs one program for `rlblocks.rewards.sandbox`: limits first, then the program.

Started by `Sandbox.run` as ``python -I sandbox_runner.py FOLDER`` in a new session (its own
process group), with stdin, stdout and stderr already redirected to files of FOLDER. FOLDER is
the parent's private folder (root-only when the parent is root): ``config`` (the limits,
the uid to run as, a nonce), ``program.py`` and ``verdict``, where this runner writes what
happened. Only the standard library is imported: this file runs under whatever interpreter the
sandbox uses, with no rlblocks installed there.

Three processes, so that every process the program starts dies with it:

    runner R (root or the caller's user, outside any namespace; session leader)
      unshare(new mount, network and pid namespaces; a user namespace too when not root)
      └── init C: pid 1 of the new pid namespace. Mounts a fresh tmpfs on /tmp, /var/tmp,
          /dev/shm and /run/lock (the program's folder is /tmp/sandbox) and a /proc that shows the
          namespace only; waits for P; writes P's wait status to ``verdict``; exits, and the
          kernel kills every process left in the namespace (setsid or double fork included).
          └── program P: rlimits, drop to the sandbox uid, no_new_privs, then exec's
              ``program.py`` in-process (one interpreter start per run, not two) and writes a
              nonce-tagged line to ``verdict``: done, exit CODE, assertion, memory, error TYPE.

Where namespaces are refused (no root and no unprivileged user namespaces), R runs P itself in
its process group (the wall-clock kill of the group still applies) and installs an audit hook
in P that refuses sockets and starting programs; the first line of ``verdict`` says which.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000
WORKDIR = "/tmp/sandbox"
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # the usual world-writable folders
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
    with open(os.path.join(folder, "program.py")) as f:
        source = f.read()
    verdict = os.open(os.path.join(folder, "verdict"), os.O_WRONLY | os.O_APPEND)
    isolation = cfg["isolation"] = _enter_namespaces(cfg) if cfg["namespaces"] else "none"
    _say(verdict, cfg["nonce"], f"isolation {isolation}")
    if isolation == "none":  # no pid namespace to hold the program: run it here
        _program(cfg, source, verdict, audit=True)
    # The parent's deadline is a SIGTERM to us: kill the namespace's pid 1, then wait until
    # the kernel has killed everything in it. Both signals are taken in this loop, one at a
    # time, so the kill never reaches a pid that we already reaped (and that may be reused).
    waited = {signal.SIGTERM, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        _init(cfg, source, verdict)
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


def _enter_namespaces(cfg: dict) -> str:
    """Unshare mount, network and pid namespaces (plus a user namespace when not root)."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    if os.geteuid() == 0:
        if libc.unshare(flags) == 0:
            return "namespaces"
        return "none"
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(flags | CLONE_NEWUSER) != 0:
        return "none"
    # Map our own uid to root inside, so that C may mount; outside it is still just us.
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return "user-namespaces"


def _init(cfg: dict, source: str, verdict: int) -> None:
    """C, pid 1 of the new namespace: private /tmp and /proc, start P, report its end."""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        size = f"size={cfg['tmp_bytes']},mode=1777".encode()
        for path in PRIVATE_TMP:
            if os.path.isdir(path):
                flags = MS_NOSUID | MS_NODEV
                _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", flags, size), f"tmpfs {path}")
        # A /proc of the namespace only, where the system allows it (some containers do not):
        # without it the host's processes are listed, but none can be signalled from here.
        libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        os.mkdir(WORKDIR, 0o700)
        with open(os.path.join(WORKDIR, "program.py"), "w") as f:
            f.write(source)
        if cfg["uid"] is not None:
            for path in (WORKDIR, os.path.join(WORKDIR, "program.py")):
                os.chown(path, cfg["uid"], cfg["uid"])
        os.chdir(WORKDIR)
    except BaseException as e:  # noqa: BLE001 -- reported to the parent as a sandbox error
        _say(verdict, cfg["nonce"], f"setup {type(e).__name__}: {e}")
        os._exit(112)
    program = os.fork()
    if program == 0:
        os.setpgid(0, 0)  # a group of its own: killpg(0) from the program cannot reach the runner
        _program(cfg, source, verdict, audit=False)
    while True:  # pid 1 adopts every orphan of the namespace: reap them until P ends
        pid, status = os.wait()
        if pid == program:
            _say(verdict, cfg["nonce"], f"status {status}")
            os._exit(0)  # the kernel now SIGKILLs whatever P left running in the namespace


def _program(cfg: dict, source: str, verdict: int, *, audit: bool) -> None:
    """P: limits and identity that the program cannot undo, then the program itself."""
    nonce = cfg["nonce"]
    try:
        limits = {
            resource.RLIMIT_CORE: 0,
            resource.RLIMIT_CPU: cfg["cpu_seconds"],
            resource.RLIMIT_AS: cfg["memory_bytes"],
            resource.RLIMIT_FSIZE: cfg["file_bytes"],
            resource.RLIMIT_NOFILE: cfg["open_files"],
            # In a user namespace the runner and pid 1 share the program's count: 2 more.
            resource.RLIMIT_NPROC: cfg["processes"] + 2 * (cfg["isolation"] == "user-namespaces"),
        }
        for which, value in limits.items():
            # CPU: the soft limit sends SIGXCPU, the hard limit one second later SIGKILL.
            hard = value + 1 if which == resource.RLIMIT_CPU else value
            resource.setrlimit(which, (value, hard))
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a new uid cleared it
        if os.getuid() == 0 and _initial_user_namespace():
            # The kernel never applies RLIMIT_NPROC to root: a fork bomb would be unbounded.
            raise PermissionError("still root in the initial user namespace: no process limit")
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        if audit:
            os.chdir(cfg["workdir"])
            sys.addaudithook(_refuse_network)
    except BaseException as e:  # noqa: BLE001 -- the sandbox could not be set up
        _say(verdict, nonce, f"setup {type(e).__name__}: {e}")
        os._exit(112)
    sys.argv, sys.path[0:0] = ["program.py"], [os.getcwd()]
    scope = {"__name__": "__main__", "__file__": "program.py", "__builtins__": __builtins__}
    try:
        code = compile(source, "program.py", "exec")  # a SyntaxError is the program's error
        exec(code, scope)  # noqa: S102
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
    _say(verdict, nonce, line)
    os._exit(exit_code & 0xFF)


def _print_traceback() -> None:
    """The current exception's traceback on stderr. Imported here: ``traceback`` costs about
    10 ms of a run (it imports ``re`` and ``tokenize``), and a passing program never needs it."""
    try:
        import traceback

        traceback.print_exc()
    except Exception:  # noqa: BLE001, S110 -- best effort: the verdict must still be said
        # Short of memory, CPython may raise MemoryError here, or SystemError ("error return
        # without exception set") from deep inside an import; neither may cost the verdict.
        pass


def _initial_user_namespace() -> bool:
    """Whether this process is in the initial user namespace (its uid map is the identity)."""
    with open("/proc/self/uid_map") as f:
        return f.read().split() == ["0", "0", "4294967295"]


def _refuse_network(event: str, args: tuple) -> None:
    if event in BLOCKED_EVENTS:
        raise PermissionError(f"sandbox: {event} is not allowed")


def _say(verdict: int, nonce: str, line: str) -> None:
    try:
        os.write(verdict, f"{nonce} {line}\n".encode())
    except OSError:
        pass


if __name__ == "__main__":
    main(sys.argv[1])
