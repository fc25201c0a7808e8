"""The watchdog reads a Ray worker's stacks while the worker is stuck in a call."""

from __future__ import annotations

import io
import sys
import time

import pytest
from ray import cloudpickle

import rlblocks as rb
from rlblocks.run import Watchdog

pytestmark = pytest.mark.ray

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers lack tests/


class Stuck:
    """A block whose call does not come back for a while."""

    def work(self, seconds: float) -> int:
        def waiting_on_a_lost_peer():
            time.sleep(seconds)

        waiting_on_a_lost_peer()
        return 1


@pytest.mark.slow
def test_a_stuck_ray_worker_shows_its_stack_in_the_report():
    with rb.placement.Ray(workers=1) as placement:
        block = placement.build("reward", Stuck)
        stream = io.StringIO()
        watchdog = Watchdog({"reward": 1.0}, workers={"reward": block}, stream=stream)
        watchdog.enter("reward", 0)
        start = time.monotonic()
        assert block.work(4.0) == 1
        watchdog.leave("reward", time.monotonic() - start)
        watchdog.close()
    first = watchdog.stalls[0][0] - start
    assert 1.0 <= first <= 1.0 + 5.0
    report = watchdog.reports[0]
    worker = report.split("--- worker reward ---")[1]
    (pid,) = block.pids()
    assert f"reward rank 0 (pid {pid}" in worker
    assert "waiting_on_a_lost_peer" in worker and "in work" in worker


@pytest.mark.slow
def test_a_recipe_s_ray_handles_are_the_watchdog_s_workers():
    # The engine and the policy of a recipe run on Ray report their workers' stacks without
    # being named: a stalled reward's report carries both.
    import torch
    from ray_helpers import policy_factory
    from toy_tasks import count_prompts

    calls = []

    def slow_reward(rollouts):
        calls.append(None)
        if len(calls) == 2:
            time.sleep(2.5)
        return torch.zeros(len(rollouts)), {"reward/mean": 0.0}

    stream = io.StringIO()
    watchdog = Watchdog({"reward": 1.0}, stream=stream)
    with rb.placement.Ray(workers=1) as placement:
        policy = placement.build("actor", policy_factory(torch.float32))
        engine = placement.build("rollout", rb.rollout.HFEngine.from_pretrained, "tiny")
        batches = rb.data.PromptBatches(count_prompts(8), prompts_per_step=2, seed=0)
        rb.recipes.grpo(policy, engine, slow_reward, batches, steps=2, group_size=2,
                        sampling=rb.SamplingParams(max_new_tokens=4),
                        run=rb.run.RunOptions(progress=False, watchdog=watchdog))  # fmt: skip
    assert set(watchdog.workers) == {"engine", "policy"}
    report = watchdog.reports[0]
    assert "step 1 is stuck in phase 'reward'" in report
    assert "--- worker engine ---\nrollout rank 0 (pid" in report
    assert "--- worker policy ---\nactor rank 0 (pid" in report
