"""The sandbox against hostile programs, for real: every case is contained, reported, and leaves
no process and no file behind (`sandbox_cases.no_leftovers`, after every test; most cases
also assert `nothing_left` at the very moment `Sandbox.run` returns, without waiting).

The fork bomb runs only after `test_the_process_limit_binds` shows, with a bounded program,
that the limit holds; these cases need root or user namespaces (Linux), and skip otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import sandbox_cases
import torch
from sandbox_cases import CONTAINED, FAST, REPO, nothing_left

from rlblocks.rewards.code_tests import code_reward, extract_program
from rlblocks.rewards.sandbox import Sandbox, SandboxLimits

# The guard and the shared fixtures, found by pytest among this module's names.
no_leftovers, box, outside = sandbox_cases.no_leftovers, sandbox_cases.box, sandbox_cases.outside
pytestmark = [
    pytest.mark.skipif(
        not os.path.exists("/proc/self/ns/net"), reason="Linux only: reads /proc, uses namespaces"
    ),
    pytest.mark.usefixtures("no_leftovers"),
]

# ---------------------------------------------------------------------- the limits bind
# Forks children that sleep, until fork fails or 40 are made, then prints how many it made
# (and its uid and the time span in which all of them were alive). Bounded: 40 at most.
FORK_SLEEPERS = """
import os, time
start, made = time.time(), 0
for _ in range(40):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
    except BlockingIOError:
        break
    made += 1
time.sleep(0.3)
print(made, os.getuid(), start, time.time())
"""


def forks_allowed(box: Sandbox) -> str:
    result = box.run(FORK_SLEEPERS)
    nothing_left()  # the sleepers died with the namespace, now, not in 30 s
    assert result.outcome == "ok", result
    return result.stdout.split()[0]


def test_the_process_limit_binds(box) -> None:
    # processes=16: the program's uid may own 16 processes; it is one, so 15 forks succeed.
    assert forks_allowed(box) == "15"


def test_the_file_size_limit_binds(box) -> None:
    limits = SandboxLimits(file_bytes=4096, output_bytes=1 << 20)
    big = Sandbox(limits).run("with open('f', 'wb') as f:\n    f.write(b'x' * 5000)")
    nothing_left()
    assert (big.outcome, big.detail) == ("error", "OSError")  # EFBIG past 4096 bytes
    assert "File too large" in big.stderr


# ---------------------------------------------------------------------- the hostile suite
def test_fork_bomb(box) -> None:
    assert forks_allowed(box) == "15", "the process limit does not hold: no fork bomb"
    program = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    result = box.run(program)
    nothing_left()
    assert result.outcome == "timeout"  # the wall clock, or the main process's CPU limit


def test_memory_bomb(box) -> None:
    result = box.run("hoard = []\nwhile True:\n    hoard.append(bytearray(8 << 20))")
    nothing_left()
    assert (result.outcome, result.detail) == ("memory", "MemoryError")


def test_infinite_loop(box) -> None:
    # CPU 1 s, wall 10 s: the CPU limit stops the busy loop even on a loaded machine.
    busy = Sandbox(SandboxLimits(cpu_seconds=1)).run("while True:\n    pass")
    idle = box.run("import time\nwhile True:\n    time.sleep(1)")  # uses no CPU: the wall clock
    nothing_left()
    assert (busy.outcome, busy.detail) == ("timeout", "CPU time 1 s (SIGXCPU)")
    assert (idle.outcome, idle.detail) == ("timeout", "wall clock 3 s")
    assert 3.0 <= idle.seconds < 3.0 + 1.0  # killed at the deadline, not later


def test_busy_children_left_behind(box) -> None:
    # Children that leave the process group (setsid), one more that double-forks, all
    # spinning; the program itself ends at once and successfully.
    program = """
import os
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                pass
        while True:
            pass
print("parent done")
"""
    result = box.run(program)
    nothing_left()  # six spinners were alive a moment ago: all gone with the namespace
    assert (result.outcome, result.stdout.strip()) == ("ok", "parent done")


def test_writing_outside_the_sandbox_folder(box, outside, tmp_path) -> None:
    target = outside / "written.txt"
    result = box.run(f"open({str(target)!r}, 'w').write('pwned')")
    # Refused (PermissionError: the folder is ours, 0755) or not there at all
    # (FileNotFoundError: the checkout lies under /tmp, which the sandbox replaces with its own
    # tmpfs, as in a CI clone made with mktemp); either way the file is not written (below).
    assert result.outcome == "error" and result.detail in CONTAINED, result
    # /tmp and the other world-writable folders are private tmpfs mounts in the sandbox: a
    # write there succeeds and disappears with the run; the caller's /tmp (here pytest's
    # tmp_path) is not even visible.
    tmp_host = tmp_path / "written.txt"
    program = f"""
for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):  # all world-writable
    open(folder + "/escaped.txt", "w").write("x")
try:
    open({str(tmp_host)!r}, 'w').write('x')
except OSError as e:
    print(type(e).__name__)
"""
    in_tmp = box.run(program)
    nothing_left()
    assert (in_tmp.outcome, in_tmp.stdout.strip()) == ("ok", "FileNotFoundError")
    assert not target.exists() and not tmp_host.exists()
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        assert not Path(folder, "escaped.txt").exists()


def test_reading_files_outside_it(box, outside) -> None:
    secret = outside / "secret.txt"
    secret.write_text("the-secret-value")
    secret.chmod(0o600)
    result = box.run(f"print(open({str(secret)!r}).read())")
    nothing_left()
    assert result.outcome == "error" and result.detail in CONTAINED, result  # as for writing
    assert "the-secret-value" not in result.stdout + result.stderr
    # What is NOT contained, as the docs say: a file every user may read is readable.
    world_readable = Path("/etc/passwd")
    assert world_readable.stat().st_mode & 0o004
    read = box.run(f"print(open({str(world_readable)!r}).read(), end='')")
    assert read.stdout == world_readable.read_text()


@pytest.fixture
def listener():
    """A real TCP server on the host's loopback; records whether anyone connected."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    accepted: list[object] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[1])
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join()
        server.close()


NETWORK = """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    print("connected")
except OSError as e:
    print(type(e).__name__)
socket.create_connection(("1.1.1.1", 53), timeout=2)
"""


def test_opening_a_network_connection(box, listener) -> None:
    port, accepted = listener
    result = box.run(NETWORK.format(port=port))
    # Without the seccomp filter, the network namespace alone: its loopback is down and is
    # not the host's, so both connections fail at once.
    alone = Sandbox(FAST, seccomp=False).run(NETWORK.format(port=port))
    nothing_left()
    # The seccomp filter refuses the IP socket itself (EPERM), before any route is looked up.
    assert result.stdout.strip() == "PermissionError"
    assert (result.outcome, result.detail) == ("error", "PermissionError")
    assert "Operation not permitted" in result.stderr
    assert alone.stdout.strip() == "OSError"  # ENETUNREACH, not ECONNREFUSED: no route at all
    assert (alone.outcome, alone.detail) == ("error", "OSError")
    assert "Network is unreachable" in alone.stderr
    assert accepted == []


def test_huge_output(box) -> None:
    limits = SandboxLimits(file_bytes=1 << 20, output_bytes=64 << 10)
    result = Sandbox(limits).run("while True:\n    print('x' * 1000)")
    nothing_left()
    assert result.outcome == "output" and len(result.stdout) == 64 << 10


def test_killing_its_parent(box) -> None:
    # The parent it can see is the namespace's pid 1 (root-owned: EPERM); the caller's pid
    # does not exist in its pid namespace.
    program = f"""
import os, signal
for pid in (os.getppid(), {os.getpid()}):
    try:
        os.kill(pid, signal.SIGKILL)
        print("killed", pid, flush=True)
    except OSError as e:
        print(type(e).__name__, flush=True)
os.killpg(0, signal.SIGKILL)  # its own process group, itself included
"""
    result = box.run(program)
    nothing_left()
    assert result.stdout.split() == ["PermissionError", "ProcessLookupError"]
    assert (result.outcome, result.detail) == ("crashed", "SIGKILL")


def test_what_a_killed_caller_left_is_removed_by_the_next_sandbox(box) -> None:
    # A caller SIGKILLed during a run never reaches its finally: its run folders (and, where a
    # cgroup is made, its slot's cgroup) stayed for good. The next process to run a sandbox
    # removes them: named after a process that no longer runs, and owned by this user.
    import signal
    import sys
    import tempfile
    import time

    root = Path(tempfile.gettempdir())  # no_leftovers' root, which the caller inherits
    call = (
        "from rlblocks.rewards.sandbox import Sandbox; Sandbox().run('import time; time.sleep(60)')"
    )
    caller = subprocess.Popen([sys.executable, "-c", call], env={**os.environ, "TMPDIR": str(root)})
    deadline = time.monotonic() + 60
    while len(sandbox_cases.sandbox_folders(root)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sandbox_cases.sandbox_folders(root)
    assert {f.name.split("-")[2 if "work" not in f.name else 3] for f in left} == {str(caller.pid)}
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    time.sleep(0.2)  # its sandboxed program dies with it (PDEATHSIG)
    assert sandbox_cases.sandbox_folders(root) == left  # still there: nobody removed them
    assert box.run("print(1)").stdout == "1\n"
    assert sandbox_cases.sandbox_folders(root) == set()  # swept by this process's first run


# ---------------------------------------------------------------------- the fallback
def test_the_fallback_without_namespaces_still_blocks_sockets(listener) -> None:
    port, accepted = listener
    result = Sandbox(FAST, namespaces=False).run(NETWORK.format(port=port))
    nothing_left()
    assert result.isolation == "none"
    assert result.stdout.strip() == "PermissionError"  # refused by the audit hook
    assert (result.outcome, result.detail) == ("error", "PermissionError")
    assert accepted == []


def test_the_fallback_kills_the_process_group_at_the_deadline() -> None:
    program = "import os, time\nos.fork()\ntime.sleep(60)"  # two sleepers in one group
    result = Sandbox(FAST, namespaces=False).run(program)
    nothing_left()
    assert (result.outcome, result.isolation) == ("timeout", "none")


# ---------------------------------------------------------------------- the reward
SUM = "a, b = map(int, input().split())\nprint(a + b)"
CASES = [{"input": "1 2\n", "output": "3"}, {"input": "5 5", "output": "10\n"}]


def test_extract_program_takes_the_last_python_block() -> None:
    text = "try\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```\n```bash\nls\n```\n"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"  # untagged, none tagged
    assert extract_program("print(4)") == "print(4)"  # no fence: the raw text
    assert extract_program("```python\nprint(5)\n```\n```python\nprint(6)") == "print(5)\n"


def test_code_reward_stdin_and_assert_styles_with_partial_credit(make_rollouts, box) -> None:
    wrong = "a, b = map(int, input().split())\nprint(a * b if a == 1 else a + b)"
    asserts = ["assert f(2) == 4", "assert f(3) == 9", "assert f(-1) == 1"]
    completions = [
        f"Here:\n```python\n{SUM}\n```",  # stdin: both cases pass -> 1
        f"```python\n{wrong}\n```",  # 1*2=2 != 3 fails, 5+5 passes -> 1/2
        "```python\ndef f(x):\n    return x * x\n```",  # assert: 3 of 3 -> 1
        "```python\ndef f(x):\n    return 2 * x\n```",  # 4 ok, 6 != 9, -2 != 1 -> 1/3
        "```python\nimport sys\nsys.exit(0)\n```",  # exits before the asserts -> 0
    ]
    tests = [CASES, CASES, asserts, asserts, asserts]
    ro = make_rollouts(completions, [{"tests": t} for t in tests])
    rewards, metrics = code_reward(sandbox=box)(ro)
    nothing_left()
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.5, 1.0, 1 / 3, 0.0]))
    # runs: 2 + 2 + 3 + 3 + 3 = 13; passed 2 + 1 + 3 + 1 + 0 = 7; failed the other 6.
    assert metrics["reward/runs"] == 13 and metrics["reward/passed"] == 7
    assert metrics["reward/failed"] == 6 and metrics["reward/error"] == 0
    assert metrics["reward/mean"] == pytest.approx((1 + 0.5 + 1 + 1 / 3) / 5)


def test_code_reward_all_or_nothing_stops_at_the_first_failure(make_rollouts, box) -> None:
    tests = {"inputs": ["1 2", "x y", "3 4"], "outputs": ["3", "?", "7"]}  # APPS style
    ro = make_rollouts([SUM, "while True: pass"], [{"tests": tests}, {"tests": CASES}])
    rewards, metrics = code_reward(sandbox=box, all_or_nothing=True)(ro)
    nothing_left()
    assert rewards.tolist() == [0.0, 0.0]
    # Row 0: passes "1 2", raises ValueError on "x y", stops (2 runs); row 1 times out once.
    assert metrics["reward/runs"] == 3 and metrics["reward/passed"] == 1
    assert metrics["reward/error"] == 1 and metrics["reward/timeout"] == 1


def test_code_reward_names_a_row_without_tests(make_rollouts, box) -> None:
    ro = make_rollouts([SUM, SUM], [{"tests": CASES}, {"tests": []}])
    with pytest.raises(ValueError, match=r"row 1: metadata\['tests'\] must be a non-empty"):
        code_reward(sandbox=box)(ro)


def test_runs_in_parallel_do_not_share_a_uid(box) -> None:
    # Two programs at once, each forking up to its limit: with one uid for both, the one that
    # forks second would find the other's 15 children counted against it.
    a, b = (r.stdout.split() for r in box.run_many([(FORK_SLEEPERS, "")] * 2))
    nothing_left()
    assert a[0] == b[0] == "15" and a[1] != b[1]
    assert float(a[2]) < float(b[3]) and float(b[2]) < float(a[3])  # their spans overlap


# ---------------------------------------------------------------------- without root
AS_NOBODY = (
    sandbox_cases.LOAD_SANDBOX
    + """
limits = sandbox.SandboxLimits(processes=16, wall_seconds=5.0)
box = sandbox.Sandbox(limits, python=sys.executable)
results = [box.run(program) for program in json.loads(sys.stdin.read())]
print(json.dumps([[r.isolation, r.outcome, r.detail, r.stdout] for r in results]))
"""
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as nobody")
def test_without_root_user_namespaces_hold(outside) -> None:
    # The sandbox module needs only the standard library: load it by path in the system's
    # python3 as uid 65534 (nobody), which cannot reach this interpreter or rlblocks' deps.
    # The folder must be searchable by nobody (0755 up to the root) for the module to load.
    python = "/usr/bin/python3"
    if not Path(python).exists() or not sandbox_cases.readable_by_all(
        REPO / "rlblocks/rewards/sandbox.py"
    ):
        pytest.skip("needs /usr/bin/python3 and a checkout every user may read")
    programs = [
        FORK_SLEEPERS,
        NETWORK.format(port=9),
        f"open({str(outside / 'written.txt')!r}, 'w').write('pwned')",
    ]
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-c"]
    done = subprocess.run(
        [*command, AS_NOBODY, str(REPO / "rlblocks/rewards/sandbox.py")],
        input=json.dumps(programs), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    nothing_left()
    fork, net, write = json.loads(done.stdout)
    if fork[0] == "none":
        pytest.skip("this system refuses unprivileged user namespaces")
    # 15 forks (processes=16 binds inside the user namespace), as uid 0 there.
    assert fork[:3] == ["user-namespaces", "ok", ""] and fork[3].split()[:2] == ["15", "0"]
    assert net[:3] == ["user-namespaces", "error", "PermissionError"]  # the seccomp filter
    assert write[:2] == ["user-namespaces", "error"] and write[2] in CONTAINED
    assert not (outside / "written.txt").exists()


def test_identical_rows_run_once(make_rollouts, box) -> None:
    # A group of 4 where 3 completions hold the same program: 2 distinct programs x 2 cases
    # run (4 runs), while the counts cover all 4 rows x 2 cases.
    fenced = f"```python\n{SUM}\n```"
    ro = make_rollouts([fenced, f"Sure!\n{fenced}", fenced, "print(3)"], [{"tests": CASES}] * 4)
    rewards, metrics = code_reward(sandbox=box)(ro)
    assert rewards.tolist() == [1.0, 1.0, 1.0, 0.5]  # print(3) matches the first case only
    assert metrics["reward/runs"] == 4 and metrics["reward/passed"] == 7
    assert metrics["reward/failed"] == 1
