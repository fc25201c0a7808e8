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
instance has its own registry, so two runs in one notebook do not collide.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rlblocks.tracking.backend import require
from rlblocks.tracking.samples import Sample


class Prometheus:
    """A tracking backend that serves the run's latest metrics at ``/metrics`` (module
    docstring)."""

    def __init__(self, port: int = 9464, *, host: str = "127.0.0.1") -> None:
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
            self.server, self.thread = client.start_http_server(port, addr=host, registry=r)
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
