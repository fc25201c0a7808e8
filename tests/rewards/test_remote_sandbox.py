"""`RemoteSandbox` against a real HTTP server that speaks SandboxFusion's ``/run_code``.

The server is a stand-in for a SandboxFusion deployment (which needs Docker): a
``http.server`` thread that runs each request's code in the local `Sandbox` and answers in
SandboxFusion's format (``status``, ``run_result.status`` Finished / TimeLimitExceeded,
``return_code``, ``stdout``, ``stderr``). What is tested is the client's half: the request it
sends, and how each answer becomes a `RunResult` and a reward.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlblocks.rewards.code_tests import code_reward
from rlblocks.rewards.remote_sandbox import RemoteSandbox
from rlblocks.rewards.sandbox import Sandbox, SandboxLimits

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/ns/net"), reason="Linux only: the stand-in runs programs"
)
LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=2.0)


class SandboxFusionStandIn(BaseHTTPRequestHandler):
    requests: list[dict] = []  # noqa: RUF012 -- shared by the test and the server thread

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if body["stdin"] == "break the service":
            reply = {"status": "SandboxError", "message": "container died", "run_result": None}
        else:
            limits = SandboxLimits(
                wall_seconds=body["run_timeout"], memory_bytes=body["memory_limit_MB"] << 20
            )
            r = Sandbox(limits, workers=1).run(body["code"], body["stdin"])
            status = "TimeLimitExceeded" if r.outcome == "timeout" else "Finished"
            run = {
                "status": status, "return_code": 0 if r.outcome == "ok" else 1,
                "stdout": r.stdout, "stderr": r.stderr, "execution_time": r.seconds,
            }  # fmt: skip
            reply = {"status": "Success" if r.outcome == "ok" else "Failed", "run_result": run}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def service():
    SandboxFusionStandIn.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), SandboxFusionStandIn)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_outcomes_through_the_service(service) -> None:
    remote = RemoteSandbox(service, limits=LIMITS, workers=2)
    programs = [
        ("print(input()[::-1])", "abc"),
        ("import sys\nsys.exit(0)", ""),
        ("assert 1 == 2", ""),
        ("raise ValueError('no')", ""),
        ("import time\ntime.sleep(60)", ""),
        ("print(1)", "break the service"),
    ]
    results = remote.run_many(programs)
    got = [(r.outcome, r.detail, r.finished) for r in results]
    assert got == [
        ("ok", "", True),
        ("ok", "", False),  # exit 0 before the last line: never wrote the nonce
        ("assertion", "AssertionError", False),
        ("error", "ValueError", False),
        ("timeout", "wall clock 2 s (remote)", False),
        ("sandbox_error", "container died", False),
    ]
    assert results[0].stdout == "cba\n" and "_rb_sys" not in results[0].stderr
    sent = SandboxFusionStandIn.requests[0]
    assert (sent["language"], sent["run_timeout"], sent["memory_limit_MB"]) == ("python", 2.0, 512)


def test_code_reward_on_the_service(service, make_rollouts) -> None:
    asserts = ["assert f(2) == 4", "assert f(3) == 9"]
    completions = ["def f(x):\n    return x * x", "def f(x):\n    return 2 * x"]
    ro = make_rollouts(completions, [{"tests": asserts}] * 2)
    rewards, metrics = code_reward(sandbox=RemoteSandbox(service, limits=LIMITS))(ro)
    # x*x passes both; 2x passes f(2) == 4 only.
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.5]))
    assert metrics["reward/passed"] == 3 and metrics["reward/failed"] == 1


def test_a_service_that_does_not_answer_is_a_sandbox_error() -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, then closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = RemoteSandbox(f"http://127.0.0.1:{port}", limits=LIMITS).run("print(1)")
    assert result.outcome == "sandbox_error" and "Connection refused" in result.detail
