"""`RemoteSandbox`: run programs on a SandboxFusion-style HTTP service, behind `Sandbox`'s interface.

`code_reward(sandbox=RemoteSandbox("http://host:8080"))` sends each run to the service's
``POST /run_code`` (SandboxFusion's API: ``{"code", "language": "python", "run_timeout",
"memory_limit_MB", "stdin"}`` in, ``{"status", "message", "run_result": {"status",
"return_code", "stdout", "stderr", "execution_time"}}`` out) instead of running it here. The
service does the isolation; what this class adds is the same `RunResult` as the local sandbox:

- ``run_result.status == "TimeLimitExceeded"`` is ``timeout``; stdout over ``output_bytes`` is
  ``output``; a ``MemoryError``, ``AssertionError`` or other exception as the last line of
  stderr is ``memory``, ``assertion`` or ``error``; a non-zero return code is ``error``, a
  negative one ``crashed``; a service that answers ``SandboxError``, an HTTP error or no answer
  within ``wall_seconds + request_slack`` is ``sandbox_error``.
- ``finished`` (assert-style tests need it) comes from a line the sandbox appends to the
  program: it writes a random nonce to stderr, so a program that exits early never writes it.
  The nonce is in the program's own source, so a program that reads its file can find it,
  and the test's ``==`` runs on the program's objects (an always-equal object passes): unlike
  the local `Sandbox`, whose checker process never holds a program object (`sandbox_check`),
  a remote assert verdict can be forged. Stdin/stdout tests are compared here, by the caller.

Only the standard library (``urllib``): no client package to install.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

from rlblocks.rewards.sandbox import RunResult, SandboxLimits, run_each

_LAST_EXCEPTION = re.compile(r"^(\w+(?:\.\w+)*)(?::|$)")


@dataclass(frozen=True)
class RemoteSandbox:
    """Runs programs on a SandboxFusion-style service at ``url``; ``workers`` requests at once.

    ``limits``: ``wall_seconds`` is sent as ``run_timeout``, ``memory_bytes`` as
    ``memory_limit_MB``, and ``output_bytes`` is applied here; the other limits are the
    service's own.
    """

    url: str
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    workers: int = 4
    request_slack: float = 10.0
    """Seconds to wait for an answer beyond ``wall_seconds`` (queueing, start-up)."""

    def run(self, program: str, stdin: str = "") -> RunResult:
        """Run ``program`` once with ``stdin`` on the service; never raises for the program."""
        nonce = secrets.token_hex(16)
        code = f"{program}\n\nimport sys as _rb_sys\n_rb_sys.stderr.write({nonce!r} + '\\n')\n"
        request = {
            "code": code,
            "language": "python",
            "run_timeout": self.limits.wall_seconds,
            "memory_limit_MB": self.limits.memory_bytes >> 20,
            "stdin": stdin,
        }
        start = time.monotonic()
        try:
            reply = _post(f"{self.url.rstrip('/')}/run_code", request,
                          timeout=self.limits.wall_seconds + self.request_slack)  # fmt: skip
        except (OSError, ValueError) as e:  # URLError, timeouts, a reply that is not JSON
            return RunResult("sandbox_error", "", "", False, time.monotonic() - start,
                             "remote", f"{type(e).__name__}: {e}")  # fmt: skip
        return _judge(reply, nonce, self.limits, time.monotonic() - start)

    def run_many(self, jobs: Iterable[tuple[str, str]]) -> list[RunResult]:
        """`run` each ``(program, stdin)``, ``workers`` at a time; results in order."""
        return run_each(self.run, jobs, self.workers)


def _post(url: str, body: dict, *, timeout: float) -> dict:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _judge(reply: dict, nonce: str, limits: SandboxLimits, seconds: float) -> RunResult:
    run = reply.get("run_result") or {}
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    finished = nonce in stderr
    stderr = stderr.replace(nonce + "\n", "")

    def result(outcome: str, detail: str = "") -> RunResult:
        out = stdout[: limits.output_bytes]
        return RunResult(outcome, out, stderr, finished, seconds, "remote", detail)

    if reply.get("status") == "SandboxError" or not run:
        return result("sandbox_error", str(reply.get("message") or reply)[:500])
    if run.get("status") == "TimeLimitExceeded":
        return result("timeout", f"wall clock {limits.wall_seconds:g} s (remote)")
    if len(stdout.encode()) > limits.output_bytes:
        return result("output", f"stdout over {limits.output_bytes} bytes")
    code = run.get("return_code")
    if code == 0:
        return result("ok")
    lines = stderr.strip().splitlines()
    match = _LAST_EXCEPTION.match(lines[-1]) if lines else None
    kind = match.group(1).rsplit(".", 1)[-1] if match else ""
    if kind == "MemoryError":
        return result("memory", kind)
    if kind == "AssertionError":
        return result("assertion", kind)
    if kind.endswith(("Error", "Exception", "Interrupt", "Exit")):
        return result("error", kind)
    if isinstance(code, int) and code < 0:
        return result("crashed", f"signal {-code}")
    return result("error", f"exit {code}")
