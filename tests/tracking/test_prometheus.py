"""rb.tracking.Prometheus: scraped over HTTP while a GRPO run goes, bound to loopback, a port
in use refused by number."""

from __future__ import annotations

import socket
import urllib.request

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import count_prompts

import rlblocks as rb
from rlblocks.run import RunOptions

pytest.importorskip("prometheus_client")


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` -> value, from the text format."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_the_endpoint_is_scraped_during_a_run(tmp_path):
    endpoint = rb.tracking.Prometheus(port=0)
    assert endpoint.host == "127.0.0.1" and endpoint.port > 0
    scraped = []

    def on_step(step, metrics, rollouts):  # during the run: the step was just logged
        scraped.append((step, metrics, scrape(endpoint.url)))

    torch.manual_seed(0)
    policy = tiny_trainer(lr=1e-3)
    engine = tiny_engine(policy, shared=True)
    tracker = rb.tracking.Tracker(tmp_path / "run", report_to=[endpoint])
    batches = rb.data.PromptBatches(count_prompts(8), prompts_per_step=2, seed=0)

    def reward(rollouts):
        values = torch.arange(len(rollouts), dtype=torch.float32) / 10
        return values, {"reward/mean": values.mean().item()}

    with tracker:
        rb.recipes.grpo(policy, engine, reward, batches, steps=2, group_size=2,
                        sampling=rb.SamplingParams(max_new_tokens=4),
                        run=RunOptions(progress=False, tracker=tracker, on_step=on_step))  # fmt: skip
    assert [s for s, _, _ in scraped] == [0, 1]
    for step, metrics, values in scraped:
        assert values["rlblocks_step"] == step
        assert values["rlblocks_reward"] == pytest.approx(0.15)  # mean of 0, .1, .2, .3
        assert values["rlblocks_staleness"] == 0.0
        assert values["rlblocks_tokens_per_second"] == pytest.approx(metrics["tokens_per_second"])
        for phase in ("rollout", "reward", "update", "sync"):
            key = f'rlblocks_phase_seconds{{phase="{phase}"}}'
            assert values[key] == pytest.approx(metrics[f"time/{phase}"])
        assert values['rlblocks_phase_seconds{phase="step"}'] == pytest.approx(
            metrics["step_seconds"]
        )
        assert values['rlblocks_memory_bytes{kind="rss"}'] > 10 * 2**20
        assert values['rlblocks_metric{name="reward/mean"}'] == pytest.approx(0.15)
    with pytest.raises(OSError):  # the tracker closed it with the run
        urllib.request.urlopen(endpoint.url, timeout=2)


def test_a_port_in_use_is_named():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 cannot be opened"):
            rb.tracking.Prometheus(port=port)
    finally:
        holder.close()


def _serving_threads() -> int:
    import threading

    return sum(1 for t in threading.enumerate() if t.name.startswith("Thread-") and t.daemon)


def test_idle_connections_are_dropped_and_cannot_pile_up_threads():
    # prometheus-client's server kept one thread per connection with no timeout: idle sockets
    # opened by any local user held a thread each, for ever.
    import time

    metrics = rb.tracking.Prometheus(port=0)  # the defaults: at most 16 at once
    before = _serving_threads()
    idle = [socket.create_connection(("127.0.0.1", metrics.port)) for _ in range(40)]
    try:
        time.sleep(0.5)
        assert _serving_threads() - before <= 16
    finally:
        for conn in idle:
            conn.close()
    time.sleep(0.5)  # closed by their clients: their threads end, the slots free
    assert "rlblocks_step" in "".join(scrape(metrics.url))
    metrics.close()
    # An idle connection is closed by the server after idle_timeout: a read sees the end.
    metrics = rb.tracking.Prometheus(port=0, idle_timeout=0.5, max_connections=4)
    conn = socket.create_connection(("127.0.0.1", metrics.port))
    try:
        conn.settimeout(5)
        start = time.monotonic()
        assert conn.recv(1) == b"" and time.monotonic() - start < 5
    finally:
        conn.close()
        metrics.close()
    with pytest.raises(ValueError, match="idle_timeout=0"):
        rb.tracking.Prometheus(port=0, idle_timeout=0)
