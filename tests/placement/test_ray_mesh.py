"""A tensor- or sequence-parallel policy on Ray workers: the mesh is built from the pool's
workers.

The pool's ranks are numbered node by node (``rlblocks.placement.pool``), so the trainer's
``(dp, tp)`` mesh puts each tensor-parallel group on consecutive ranks, within a node's
workers, and data parallelism across; one line of the factory (``tp=2``) switches the layout.
"""

import pytest
import torch
from ray_helpers import LOSS, grpo_batch, kill_mid_step, policy_factory

import rlblocks as rb

# Slow (a minute or more together on 2 cores): .ci/run runs them in a step of their own, keeping
# the default run under 15 minutes.
pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = {"num_key_value_heads": 2}  # every size of the tiny model splits two ways


@pytest.mark.parametrize("layout", [{"tp": 2}, {"sp": 2}], ids=["tp2", "sp2"])
def test_a_tp2_or_sp2_policy_on_two_workers_steps_like_one_process_and_syncs(tmp_path, layout):
    # The bound of tests/trainer/test_tensor_parallel.py (float64, summation order only).
    folder = rb.models.save_tiny(tmp_path / "tiny", **MODEL)
    policy = policy_factory(model_config=MODEL)()
    engine = rb.rollout.HFEngine.from_pretrained(str(folder), progress=False)
    with rb.placement.Ray(workers=2) as placement:
        remote = placement.build("actor", policy_factory(model_config=MODEL, **layout))
        remote_engine = placement.build(
            "rollout", rb.rollout.HFEngine.from_pretrained, str(folder), progress=False
        )
        assert remote.layout == {"dp": 1, "tp": 1, "sp": 1, **layout}  # rank 0's view
        for step in range(2):
            ro, advantages = grpo_batch(engine, step)
            local = policy.step(ro, advantages, loss_fn=LOSS)
            metrics = remote.step(ro, advantages, loss_fn=LOSS)
            assert metrics["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-9)
        # Scoring by rows: each tensor- or sequence-parallel pair scores the same rows
        # (row_replicas);
        # float32 out, so equal to float32 rounding of the float64 scores.
        torch.testing.assert_close(remote.logprobs(ro), policy.logprobs(ro), rtol=1e-6, atol=1e-6)
        rb.resharder.Resharder(bucket_mb=0.05).sync(remote, remote_engine)
        held = remote_engine.model.state_dict()
        for name, value in policy.named_weights():
            torch.testing.assert_close(held[name].double(), value, rtol=1e-6, atol=1e-6)


def test_a_tensor_parallel_rank_killed_mid_step_fails_the_step_naming_it(tmp_path):
    # As with FSDP (tests/placement/test_ray_faults.py): the surviving rank waits in a
    # tensor-parallel all-reduce for the dead one; the step fails within the pool's grace
    # period, naming the rank, instead of hanging.
    from rlblocks.placement import WorkerDied

    folder = rb.models.save_tiny(tmp_path / "tiny", **MODEL)
    engine = rb.rollout.HFEngine.from_pretrained(str(folder), progress=False)
    ro, advantages = grpo_batch(engine, 0)
    ro, advantages = ro.repeat(200), advantages.repeat_interleave(200, dim=0)  # a long step
    with rb.placement.Ray(workers=2) as placement:
        policy = placement.build("actor", policy_factory(torch.float32, model_config=MODEL, tp=2))
        outcome = kill_mid_step(policy, ro, advantages)
        assert not outcome["alive"]
        assert isinstance(outcome["error"], WorkerDied), outcome["error"]
        assert (outcome["error"].role, outcome["error"].rank) == ("actor", 1)
        assert outcome["seconds"] < 60
