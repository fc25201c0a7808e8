"""The sandbox against what a hostile suite found it let through: IPC that outlives the run, host
Unix sockets, system calls with no business in a test program, memory spread over children,
unlimited tmpfs inodes, and rewards paid to always-equal objects and forged verdicts.

Every case runs real sandboxed programs and checks, from the host, what they left or reached;
each fails on the sandbox before this hardening (seen: segments left, the world-writable socket
connected, the calls made, "all held", 10000 files, full reward to the forgeries).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import sandbox_cases
import torch
from sandbox_cases import FAST, REPO, nothing_left

from rlblocks.rewards import sandbox_cgroup
from rlblocks.rewards.code_tests import code_reward
from rlblocks.rewards.sandbox import Sandbox, SandboxLimits

no_leftovers, box, outside = sandbox_cases.no_leftovers, sandbox_cases.box, sandbox_cases.outside
pytestmark = [
    pytest.mark.skipif(
        not os.path.exists("/proc/self/ns/net"), reason="Linux only: reads /proc, uses namespaces"
    ),
    pytest.mark.usefixtures("no_leftovers"),
]
EPERM = 1


# ---------------------------------------------------------------------- SysV IPC
SHM_PROGRAM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for key in {keys}:
    shmid = libc.shmget(key, 4 << 20, 0o1600)  # IPC_CREAT | 0600, 4 MiB
    if shmid < 0:
        print(-ctypes.get_errno())
        continue
    address = libc.shmat(shmid, None, 0)
    ctypes.memset(address, 1, 4 << 20)  # its pages are really held
    libc.shmdt(ctypes.c_void_p(address))
    print(shmid)
"""


def host_segments(keys: list[int]) -> dict[int, int]:
    """{key: shmid} of the host's SysV shared memory segments with one of ``keys`` (what
    ``ipcs -m`` lists, read from its source)."""
    found = {}
    for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]:
        key, shmid = (int(x) for x in line.split()[:2])
        if key in keys:
            found[key] = shmid
    return found


def test_sysv_shared_memory_is_gone_with_the_run() -> None:
    keys = [0x52420000 + secrets.randbelow(1 << 16) * 4 + i for i in range(3)]
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        refused = Sandbox(FAST).run(SHM_PROGRAM.format(keys=keys))
        assert host_segments(keys) == {}, "segments outlived the run"
        # The seccomp filter refuses the calls outright.
        assert refused.stdout.split() == [f"-{EPERM}"] * 3, refused
        # Without the filter, the IPC namespace alone: made and used inside, gone after.
        alone = Sandbox(FAST, seccomp=False).run(SHM_PROGRAM.format(keys=keys))
        nothing_left()
        assert alone.outcome == "ok" and all(int(i) >= 0 for i in alone.stdout.split()), alone
        assert host_segments(keys) == {}, "segments outlived the run"
    finally:  # what an unhardened sandbox leaves: removed, so a failure costs the host nothing
        for shmid in host_segments(keys).values():
            libc.shmctl(shmid, 0, None)  # IPC_RMID


# ---------------------------------------------------------------------- host Unix sockets
@pytest.fixture
def host_sockets(tmp_path):
    """Three Unix sockets of the host, listening; yields (paths, abstract name, accepted)."""
    shared = Path(tempfile.mkdtemp(prefix="shared-tmp-", dir=REPO))  # like a world-writable tmp
    shared.chmod(0o1777)
    paths = [str(tmp_path / "host.sock"), str(shared / "world.sock")]
    abstract = "\0rlblocks-test-" + secrets.token_hex(8)
    servers = []
    for address in (*paths, abstract):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen()
        servers.append(server)
    for path in paths:
        os.chmod(path, 0o777)  # world-writable: any uid may connect
    accepted: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            for server in select.select(servers, [], [], 0.05)[0]:
                accepted.append(server.getsockname())
                server.accept()[0].close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield paths, abstract, accepted
    finally:
        stop.set()
        thread.join()
        for server in servers:
            server.close()
        for path in shared.iterdir():
            path.unlink()
        shared.rmdir()


CONNECT = """
import socket
for address in {addresses!r}:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(address)
        print("connected")
    except OSError as e:
        print(type(e).__name__)
"""


def test_host_unix_sockets_are_unreachable(box, host_sockets) -> None:
    paths, abstract, accepted = host_sockets
    result = box.run(CONNECT.format(addresses=[*paths, abstract]))
    nothing_left()
    # The paths are not in the program's root; the abstract name belongs to the host's
    # network namespace, not the program's.
    assert result.stdout.split() == [
        "FileNotFoundError", "FileNotFoundError", "ConnectionRefusedError",
    ], result  # fmt: skip
    assert accepted == []


def test_the_program_root_holds_only_the_system_folders(box) -> None:
    result = box.run("import os\nprint(*sorted(os.listdir('/')))")
    nothing_left()
    # No /run content (sockets of the system's services), /var, /home, /root, /work, /sys...
    assert set(result.stdout.split()) <= {
        "bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin", "tmp",
        "usr", "var",
    }, result  # fmt: skip
    listing = box.run("import os\nprint(sorted(os.listdir('/run')), sorted(os.listdir('/var')))")
    assert listing.stdout.strip() == "['lock'] ['run', 'tmp']"


# ---------------------------------------------------------------------- system calls
NUMBERS = {  # the calls libc has no wrapper for
    "x86_64": {"keyctl": 250, "bpf": 321, "io_uring_setup": 425, "setns": 308},
    "aarch64": {"keyctl": 219, "bpf": 280, "io_uring_setup": 425, "setns": 268},
}
SYSCALLS = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
N = {numbers}

def call(name, fn):
    ctypes.set_errno(0)
    print(name, 0 if fn() != -1 else ctypes.get_errno())

call("ptrace", lambda: libc.ptrace(0, 0, 0, 0))  # PTRACE_TRACEME
call("personality", lambda: libc.personality(ctypes.c_ulong(0x0040000)))  # no ASLR
call("unshare", lambda: libc.unshare(0x10000000))  # a new user namespace
call("setns", lambda: libc.syscall(N["setns"], os.open("/proc/self/ns/net", 0), 0))
call("keyctl", lambda: libc.syscall(N["keyctl"], 0, -3, 1))  # the session keyring
call("bpf", lambda: libc.syscall(N["bpf"], 0, None, 0))
call("io_uring_setup", lambda: libc.syscall(N["io_uring_setup"], 1,
                                            ctypes.create_string_buffer(120)))
call("mount", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
def shmget():  # a segment made is removed at once: none outlives the test on any sandbox
    shmid = libc.shmget(0, 4096, 0o1600)
    return shmid if shmid < 0 else libc.shmctl(shmid, 0, None) * 0

call("shmget", shmget)
for name, make in (("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)),
                   ("inet", lambda: socket.socket()), ("memfd_create", lambda: os.memfd_create("m"))):
    try:
        make()
        print(name, 0)
    except OSError as e:
        print(name, e.errno)
a, b = socket.socketpair()  # AF_UNIX stays allowed
print("socketpair", 0)
print("seccomp", open("/proc/self/status").read().split("Seccomp:")[1].split()[0])
"""


def test_forbidden_system_calls_are_refused(box) -> None:
    numbers = NUMBERS.get(os.uname().machine)
    if numbers is None:
        pytest.skip(f"no call numbers written down for {os.uname().machine}")
    result = box.run(SYSCALLS.format(numbers=numbers))
    nothing_left()
    said = dict(line.split() for line in result.stdout.splitlines())
    refused = ["ptrace", "personality", "unshare", "setns", "keyctl", "bpf", "io_uring_setup",
               "mount", "shmget", "netlink", "inet", "memfd_create"]  # fmt: skip
    assert said == {name: str(EPERM) for name in refused} | {"socketpair": "0", "seccomp": "2"}
    assert result.outcome == "ok", result


# ---------------------------------------------------------------------- memory of the whole run
SIX_CHILDREN = """
import os, select
r, w = os.pipe()
for _ in range(6):
    if os.fork() == 0:
        block = b"\\x01" * (100 << 20)  # 100 MiB, every page written
        os.write(w, b"+")
        select.select([], [], [], 30)
        os._exit(0)
os.close(w)
held = b""
while len(held) < 6:
    if select.select([r], [], [], 0.05)[0]:
        held += os.read(r, 6)
    if os.waitpid(-1, os.WNOHANG)[0]:
        print("a child was killed", flush=True)
        break
if len(held) == 6:
    print("all held", flush=True)  # 600 MiB at once
"""
TREE = SandboxLimits(cpu_seconds=5, wall_seconds=10.0, memory_bytes=256 << 20, processes=16)


def _cgroup_v2_here() -> str:
    """Why cgroup v2 bounds no run here (the skip reason), from the mount table."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] == "cgroup2":
            controllers = Path(fields[4], "cgroup.controllers").read_text().split()
            return (f"the cgroup v2 hierarchy at {fields[4]} offers {controllers or 'none'} "
                    "of the controllers, not memory (hybrid layout)")  # fmt: skip
    return "no cgroup v2 hierarchy is mounted"


@pytest.mark.parametrize("how", ["cgroup v2", "cgroup v1", "pid 1's watch"])
def test_six_children_cannot_exceed_the_run_memory(how) -> None:
    version = sandbox_cgroup.available()
    if how == "cgroup v2" and version != 2:
        pytest.skip(f"runs are bounded by cgroup v{version} here, not v2: {_cgroup_v2_here()}")
    if how == "cgroup v1" and version != 1:
        pytest.skip(f"no writable cgroup v1 memory controller here (cgroup v{version} or none)")
    # Each child is within its own limit (RLIMIT_AS 256 MiB); six of them are not.
    box = Sandbox(TREE) if how.startswith("cgroup") else Sandbox(TREE, cgroups=False)
    result = box.run(SIX_CHILDREN)
    nothing_left()
    assert "all held" not in result.stdout, result
    assert result.outcome == "memory", result
    assert result.detail.startswith(f"the whole run over {256 << 20} bytes ({how}"), result


def test_one_process_still_meets_its_own_limit_first(box) -> None:
    # Below the whole run's limit, a lone allocation past RLIMIT_AS is the program's
    # MemoryError, as before, and not a kill by the cgroup or the watch.
    for sandbox in (box, Sandbox(FAST, cgroups=False)):
        result = sandbox.run("hoard = []\nwhile True:\n    hoard.append(bytearray(8 << 20))")
        assert (result.outcome, result.detail) == ("memory", "MemoryError"), result


# ---------------------------------------------------------------------- tmpfs inodes
INODES = """
import errno
for folder in ("/tmp/sandbox", "/dev/shm"):
    made = 0
    try:
        for i in range(10_000):
            open(f"{folder}/f{i}", "w").close()
            made += 1
        print(made, "none")
    except OSError as e:
        print(made, errno.errorcode[e.errno])
"""


def test_tmpfs_inodes_are_limited(box) -> None:
    result = box.run(INODES)
    nothing_left()
    lines = [line.split() for line in result.stdout.splitlines()]
    # 4096 inodes per tmpfs (the default tmp_inodes), a few already taken (its root, the
    # program's folder and file): the program makes fewer files, then ENOSPC.
    assert len(lines) == 2 and all(4000 < int(made) < 4096 for made, _ in lines), result
    assert [why for _, why in lines] == ["ENOSPC", "ENOSPC"]


# ---------------------------------------------------------------------- rewards that cannot be forged
ALWAYS_EQUAL = [  # an object equal to everything, true, and not unequal to anything
    """
class E:
    __eq__ = lambda s, o: True
    __ne__ = lambda s, o: False
    __bool__ = lambda s: True
    __hash__ = lambda s: 0

def f(x):
    return E()
""",
    """
class I(int):  # the same, dressed as an int: isinstance(f(2), int) holds
    __eq__ = lambda s, o: True
    __hash__ = int.__hash__

def f(x):
    return I(0)
""",
    """
class E:  # the same, lying about its class too
    __eq__ = lambda s, o: True
    __class__ = property(lambda s: int)

def f(x):
    return E()
""",
]
FORGED = [
    # Today's verdict line: the wrapper's nonce read from its frame, written to every fd,
    # then leave before the asserts.
    """
import os, sys
line = sys._getframe(1).f_locals["nonce"] + " done\\n"
[os.write(fd, line.encode()) for fd in range(3, 20) if os.path.exists(f"/proc/self/fd/{fd}")]
os._exit(0)
""",
    # Whatever the runner might read as a verdict, on every fd and on stdout, then leave.
    """
import os
for fd in range(64):
    for line in (b"check passed\\n", b"done\\n", b"status 0\\n"):
        try:
            os.write(fd, line)
        except OSError:
            pass
print("check passed")
os._exit(0)
""",
    # Find the expected value in its own memory (the frames above it, every container) and
    # answer with it: the test's text is never in the program's process.
    """
import gc, re, sys

def f(x):
    expected = re.compile(rf"f\\({x}\\) == (-?\\d+)")
    frames, frame = [], sys._getframe()
    while frame:
        frames.append(list(frame.f_locals.values()))
        frame = frame.f_back
    for o in frames + gc.get_objects():
        items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()
        for s in items:
            found = expected.search(s) if isinstance(s, str) else None
            if found:
                return int(found.group(1))
""",
]


def test_always_equal_objects_and_forged_verdicts_earn_nothing(make_rollouts, box) -> None:
    honest = "def f(x):\n    return x * x\n"
    programs = [honest, *ALWAYS_EQUAL, *FORGED]
    tests = ["assert f(2) == 4", "assert f(3) == 9", "assert f(5) == 25"]
    ro = make_rollouts(programs, [{"tests": tests}] * len(programs))
    rewards, metrics = code_reward(sandbox=box)(ro)
    nothing_left()
    torch.testing.assert_close(rewards, torch.tensor([1.0] + [0.0] * (len(programs) - 1)))
    assert metrics["reward/sandbox_error"] == 0


def test_the_checker_keeps_the_meaning_of_honest_tests(make_rollouts, box) -> None:
    program = """
import math

class Solution:
    def two_sum(self, nums, target):
        seen = {}
        for i, n in enumerate(nums):
            if target - n in seen:
                return [seen[target - n], i]
            seen[n] = i

def squares(n):
    yield from (i * i for i in range(n))

def half(x):
    if x < 0:
        raise ValueError("negative")
    return x / 2

def sorted(items):  # shadows a builtin: the tests keep the builtin
    return []

LIMIT = 10
"""
    tests = [
        "assert Solution().two_sum([2, 7, 11], 9) == [0, 1]",  # a program class, a method
        "assert list(squares(4)) == [0, 1, 4, 9]",  # a generator, listed in the program
        "assert abs(half(1) - 0.5) < 1e-9 and math.isclose(half(3), 1.5)",  # the program's math
        "try:\n    half(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError",
        "assert LIMIT == 10 and sorted([3, 1, 2]) == [1, 2, 3]",
        "assert all(half(2 * i) == i for i in range(5))",
        "assert {'a': (1, 2.5, None, b'x', {3})} == {'a': (1, 2.5, None, b'x', {3})}",
    ]
    results = [box.run(program, test=t) for t in tests]
    assert [r.check for r in results] == ["passed"] * len(tests), results
    ro = make_rollouts([program], [{"tests": tests}])
    rewards, _ = code_reward(sandbox=box)(ro)
    assert rewards.tolist() == [1.0]
    # A stand-in for a standard module the test leans on is not the module in the test.
    fake_math = "class M:\n    isclose = staticmethod(lambda a, b: True)\n\nmath = M()\nf = abs"
    leaned = box.run(fake_math, test="assert math.isclose(f(-2), 3)")
    assert leaned.check.startswith("failed AssertionError"), leaned
    # What the program raises, or a comparison of its own objects, fails the test.
    failing = box.run(program, test="assert half(-1) == 0")
    compared = box.run(program, test="assert Solution() == Solution()")
    assert failing.check == "error ValueError: negative", failing
    assert compared.check.startswith("error TypeError: Sandbox.run: the test compared"), compared


# ---------------------------------------------------------------------- without libseccomp
WITHOUT_LIBSECCOMP = """
from rlblocks.rewards.sandbox import Sandbox
for box in (Sandbox(), Sandbox(seccomp=False)):
    r = box.run("print(1)")
    print(r.outcome, "|", r.detail, "|", r.stdout.strip())
"""


def test_a_missing_libseccomp_is_a_sandbox_error_that_names_it(tmp_path) -> None:
    # The real library hidden by an empty file in a mount namespace of the test's own.
    ctypes.CDLL("libseccomp.so.2")
    maps = Path("/proc/self/maps").read_text().split()
    library = next(field for field in maps if "/libseccomp.so" in field)
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) to hide the library in a mount namespace")
    script = tmp_path / "script.py"
    script.write_text(WITHOUT_LIBSECCOMP)
    hide = f"mount --bind /dev/null {library} && exec {sys.executable} {script}"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    nothing_left()
    assert done.returncode == 0, done.stderr
    refused, alone = (line.split(" | ") for line in done.stdout.splitlines())
    assert refused[0] == "sandbox_error"
    assert "libseccomp.so.2 cannot be loaded" in refused[1]
    assert "install libseccomp2 or pass Sandbox(seccomp=False)" in refused[1]
    assert alone == ["ok", "", "1"]


# ---------------------------------------------------------------------- the weakest fallback
AS_NOBODY = (
    sandbox_cases.LOAD_SANDBOX
    + """
box = sandbox.Sandbox(sandbox.SandboxLimits(wall_seconds=5.0), namespaces=False)
result = box.run(sys.stdin.read(), test="assert f(2) == 4")
print(json.dumps([result.isolation, result.check]))
"""
)
# Without namespaces and as the caller's own uid, the program can open the caller's end of the
# report pipe through /proc and write a verdict line into it.
INTO_THE_PIPE = """
import os
parent = os.getppid()
for fd in os.listdir(f"/proc/{parent}/fd"):
    try:
        os.write(os.open(f"/proc/{parent}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK), b"check passed\\n")
    except OSError:
        pass

def f(x):
    return 0
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as nobody")
def test_a_verdict_written_into_the_report_pipe_does_not_count() -> None:
    module = REPO / "rlblocks/rewards/sandbox.py"
    if not Path("/usr/bin/python3").exists() or not sandbox_cases.readable_by_all(module):
        pytest.skip("needs /usr/bin/python3 and a checkout every user may read")
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3"]
    done = subprocess.run(
        [*command, "-I", "-c", AS_NOBODY, str(module)],
        input=INTO_THE_PIPE, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    nothing_left()
    isolation, check = json.loads(done.stdout)
    assert isolation == "none"
    assert check == "failed AssertionError: ", check  # the checker's own verdict, not the forgery


def test_a_program_that_never_answers_fails_its_test(box) -> None:
    # It closes its end of the checker's pipes (every fd past stderr) and lingers: the checker's
    # first request meets a closed pipe, which is the program ending before its tests, not an
    # error of the test (before, this depended on timing: 1 run in 30 said BrokenPipeError).
    program = "import os, time\nos.closerange(3, 1024)\ntime.sleep(0.5)\n"
    results = [box.run(program, test="assert f(2) == 4") for _ in range(3)]
    nothing_left()
    assert [r.check for r in results] == ["failed the program ended before its tests were done"] * 3
