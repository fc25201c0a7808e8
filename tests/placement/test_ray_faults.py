"""Failures of Ray workers: a killed worker is reported within seconds, nothing is left running."""

import psutil
import pytest
import torch
from ray_helpers import LOSS, grpo_batch, kill_mid_step, policy_factory

import rlblocks as rb
from rlblocks.placement import PoolBroken, WorkerDied

# Slow (about 35 s together): .ci/run runs them in its Ray step.
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_killed_worker_fails_fast_and_shutdown_leaves_no_process():
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}  # not Ray's
    placement = rb.placement.Ray(workers=2)
    policy = placement.build("actor", policy_factory(torch.float32))
    pids = policy.pids()
    ro, advantages = grpo_batch(rb.rollout.HFEngine.from_pretrained("tiny", progress=False), 0)
    ro = ro.repeat(200)  # 2400 rows, 600 optimizer steps: a step of a minute or more
    outcome = kill_mid_step(policy, ro, advantages.repeat_interleave(200, dim=0))
    assert not outcome["alive"]
    error = outcome["error"]
    assert isinstance(error, WorkerDied), error
    assert "actor worker rank 1" in str(error) and "died during step" in str(error)
    assert (error.role, error.rank) == ("actor", 1)
    assert outcome["seconds"] < 60
    with pytest.raises(PoolBroken, match="actor rank 1 died in step; build its blocks again"):
        policy.logprobs(ro.select([0]))
    rebuilt = placement.build("actor", policy_factory(torch.float32))  # a fresh pool
    assert rebuilt.logprobs(ro.select([0, 1])).shape == (2, ro.response_ids.shape[1])
    # Everything this Ray instance started (GCS, raylet, workers, agents) is a descendant of
    # this process; other Ray instances on the machine are not ours to check.
    # (Processes this one had before, such as multiprocessing's resource tracker, are not.)
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in earlier]
    names = {p.name() for p in started}
    assert {"raylet", "gcs_server"} <= names, names
    placement.shutdown()
    _, alive = psutil.wait_procs(started, timeout=30)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [(p.pid, p.name()) for p in alive]
    assert not any(psutil.pid_exists(p) for p in rebuilt.pids() + pids)


def test_a_lora_policy_trains_sharded_over_two_workers():
    # FSDP2 over the pool's two workers, base weights frozen in the same units as the adapters
    # (before, a LoRA policy in a pool of more than one raised NotImplementedError); the merged
    # weights come back whole through the handle (tests/trainer/test_parallel.py compares the
    # update with one process's).
    from peft import LoraConfig

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    with rb.placement.Ray(workers=2) as placement:
        policy = placement.build("actor", policy_factory(torch.float32), lora=lora)
        ro, advantages = grpo_batch(rb.rollout.HFEngine.from_pretrained("tiny", progress=False), 0)
        before = dict(policy.named_weights())
        metrics = policy.step(ro, advantages, loss_fn=LOSS)
        assert metrics["optimizer_steps"] == 3
        after = dict(policy.named_weights())  # merged W + (α/r)·BA under the base names
        assert not torch.equal(
            after["model.layers.0.self_attn.q_proj.weight"],
            before["model.layers.0.self_attn.q_proj.weight"],
        )
        assert torch.equal(
            after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"]
        )
