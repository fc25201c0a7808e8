"""Shared set-up of the Ray placement tests: the tiny policy, a seeded GRPO batch, the loss."""

from functools import partial

import builders
import torch
from builders import tiny_trainer
from ray import cloudpickle
from toy_tasks import digit_fraction

import rlblocks as rb

# The factories travel to the Ray workers, whose sys.path lacks tests/: builders goes by value.
cloudpickle.register_pickle_by_value(builders)

PROMPTS = ["What is 2 + 3?", "Say hi", "7 times 8", "Tom has 3 apples.", "one two"]
LOSS = partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28))
TRAIN = {
    "lr": 1e-3,
    "mini_batch_size": 4,
    "micro_batch_size": 3,
    "reference": None,
    "log_entropy": True,
}


def policy_factory(dtype=torch.float64, **overrides):
    settings = {**TRAIN, **overrides}
    return partial(tiny_trainer, dtype, **settings)


def local_blocks():
    policy = policy_factory()()
    engine = rb.rollout.HFEngine.from_pretrained("tiny", progress=False)
    return policy, engine


def grpo_batch(engine, step):
    sampling = rb.SamplingParams(max_new_tokens=8, seed=step)
    ro = engine.generate(PROMPTS[:3], group_size=4, sampling=sampling)
    rewards, _ = rb.rewards.per_sample(digit_fraction)(ro)
    advantages, _ = rb.advantage.grpo(
        rewards + 0.1 * torch.arange(len(ro)), ro.response_mask, ro.group_ids
    )
    return ro, advantages


def kill_mid_step(policy, ro, advantages, *, rank: int = 1) -> dict:
    """Start ``policy.step`` on a long batch in a thread, ``kill -9`` worker ``rank`` two
    seconds in, and wait (at most 90 s): ``{"error": what the step raised, "seconds": its
    duration}``; ``"alive"`` is True if the step was still running after 90 s."""
    import os
    import signal
    import threading
    import time

    outcome = {}

    def step():
        start = time.perf_counter()
        try:
            policy.step(ro, advantages, loss_fn=LOSS)
        except Exception as e:  # noqa: BLE001 - the caller inspects it
            outcome["error"] = e
        outcome["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=step)
    thread.start()
    time.sleep(2.0)  # the step is running on every rank
    os.kill(policy.pids()[rank], signal.SIGKILL)
    thread.join(timeout=90)
    outcome["alive"] = thread.is_alive()
    return outcome
