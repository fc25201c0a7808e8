"""Live metrics over HTTP for Prometheus (``prometheus-client``), as one more tracking backend::

    metrics = rb.tracking.Prometheus(port=9464)            # http://127.0.0.1:9464/metrics
    tracker = rb.tracking.Tracker("runs/grpo", report_to=["tensorboard", metrics])

It serves, after every logged step:

- ``rlblocks_step``: the last step logged;
- ``rlblocks_reward``: ``reward/mean``; ``rlblocks_tokens_per_second``: the trainer's
  ``tokens_per_second``; ``rlblocks_staleness``: ``async/staleness`` (0 for a synchronous run);
- ``rlblocks_phase_seconds{phase=...}``: the step's ``time/<phase>`` and ``step_seconds``
  (``phase="step"``);
- ``rlblocks_memory_bytes{kind=...}``: this process's resident set (``rss``) and, on a GPU,
  ``cuda_allocated`` and ``cuda_max_allocated``, read when the step is logged;
- ``rlblocks_metric{name=...}``: every scalar the step logged, under its own name.

It binds to the loopback address by default (``host="127.0.0.1"``): a run's metrics are not
offered to the network unless ``host="0.0.0.0"`` says so. ``port=0`` takes any free port
(``.port`` says which). A port in use is refused by number. It is not among the names
``report_to="all"`` starts: opening a port is asked for by building this object. Each
instance has its own registry, so two runs in one notebook do not collide. Each connection
is served in its own thread that gives up after ``idle_timeout`` seconds of silence, at most
``max_connections`` at once (more are closed unread): idle sockets cannot pile up threads.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from rlblocks.tracking.backend import require
from rlblocks.tracking.samples import Sample


class Prometheus:
    """A tracking backend that serves the run's latest metrics at ``/metrics`` (module
    docstring)."""

    def __init__(
        self,
        port: int = 9464,
        *,
        host: str = "127.0.0.1",
        idle_timeout: float = 10.0,
        max_connections: int = 16,
    ) -> None:
        if not 0 < idle_timeout < math.inf:
            raise ValueError(
                f"Prometheus: idle_timeout={idle_timeout!r}; pass the seconds a connection may "
                "stay silent, a finite number > 0"
            )
        if (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or max_connections < 1
        ):
            raise ValueError(
                f"Prometheus: max_connections={max_connections!r}; pass the connections served "
                "at once, an int >= 1"
            )
        client = require("prometheus_client", "prometheus-client")
        self.host = host
        self.registry = client.CollectorRegistry()
        gauge = client.Gauge
        r = self.registry
        self.step = gauge("rlblocks_step", "The last step logged", registry=r)
        self.reward = gauge("rlblocks_reward", "reward/mean of the last step", registry=r)
        self.tokens = gauge("rlblocks_tokens_per_second", "The trainer's tokens per second",
                            registry=r)  # fmt: skip
        self.staleness = gauge("rlblocks_staleness", "async/staleness of the last step",
                               registry=r)  # fmt: skip
        self.phases = gauge("rlblocks_phase_seconds", "Seconds of each phase of the last step",
                            ["phase"], registry=r)  # fmt: skip
        self.memory = gauge("rlblocks_memory_bytes", "Memory of this process when the step was "
                            "logged", ["kind"], registry=r)  # fmt: skip
        self.metric = gauge("rlblocks_metric", "Every scalar metric of the last step",
                            ["name"], registry=r)  # fmt: skip
        try:
            self.server, self.thread = _serve(
                client.make_wsgi_app(r), host, port, idle_timeout, max_connections
            )
        except OSError as error:
            raise OSError(
                error.errno,
                f"Prometheus: port {port} on {host} cannot be opened ({error.strerror}); "
                "another process holds it: pass another port=, or port=0 for any free one",
            ) from error
        self.port = self.server.server_port
        self._closed = False

    @property
    def url(self) -> str:
        """Where the metrics are served: ``http://<host>:<port>/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    def start(self, config: Mapping[str, Any], resume_step: int | None = None) -> None:
        """Nothing to record: the endpoint serves metrics, not the configuration."""

    def log_metrics(self, step: int, scalars: Mapping[str, float]) -> None:
        """Serve this step's metrics from now on (module docstring), and the memory now."""
        self.step.set(step)
        for key, value in scalars.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self.metric.labels(name=key).set(value)
        named = {"reward/mean": self.reward, "tokens_per_second": self.tokens}
        for key, target in named.items():
            if key in scalars:
                target.set(scalars[key])
        self.staleness.set(scalars.get("async/staleness", 0.0))
        for key, value in scalars.items():  # the loop's time/<phase>, whatever its phases
            if key.startswith("time/"):
                self.phases.labels(phase=key.removeprefix("time/")).set(value)
        if "step_seconds" in scalars:
            self.phases.labels(phase="step").set(scalars["step_seconds"])
        for kind, value in memory().items():
            self.memory.labels(kind=kind).set(value)

    def log_samples(self, step: int, rows: Sequence[Sample]) -> None:
        """Samples are not metrics: nothing served."""

    def close(self) -> None:
        """Stop serving; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.server.shutdown()
        self.server.server_close()


def _serve(
    app: Any, host: str, port: int, idle_timeout: float, max_connections: int
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``app`` in a daemon thread, each connection in its own thread that gives up after
    ``idle_timeout`` silent seconds, at most ``max_connections`` at once (a connection past
    them is closed unread). prometheus-client's own server keeps a thread per connection with
    no timeout: any local user could hold thousands of threads by opening idle sockets."""
    slots = threading.BoundedSemaphore(max_connections)

    class Handler(WSGIRequestHandler):
        timeout = idle_timeout  # socketserver sets it on the connection's socket

        def log_message(self, format: str, *args: Any) -> None:
            """Scrapes are not logged."""

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

        def process_request(self, request: Any, client_address: Any) -> None:
            if not slots.acquire(blocking=False):
                self.shutdown_request(request)  # too many at once: closed unread
                return
            super().process_request(request, client_address)

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

        def handle_error(self, request: Any, client_address: Any) -> None:
            """A connection that timed out or broke is closed; nothing printed."""

    server = make_server(host, port, app, Server, handler_class=Handler)
    thread = threading.Thread(target=server.serve_forever, name="prometheus", daemon=True)
    thread.start()
    return server, thread


def memory() -> dict[str, float]:
    """This process's resident set and, on a GPU, torch's allocated and peak bytes."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/statm") as file:
            out["rss"] = int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated"] = torch.cuda.memory_allocated()
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    return out
