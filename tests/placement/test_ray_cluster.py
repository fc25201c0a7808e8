"""Two simulated nodes (``ray.cluster_utils.Cluster``): a pool spread over both, a split layout.

Each node is its own raylet with its own resources, so the placement group really has to put
one worker on each node, the gloo process group spans the two, and the split layout's weights
travel from one node's worker to the other through Ray's object store.
"""

import pytest
import torch
from ray.cluster_utils import Cluster
from ray_helpers import LOSS, PROMPTS, grpo_batch, local_blocks, policy_factory

import rlblocks as rb
from rlblocks.placement import Pool

# Slow (a minute or more together on 2 cores): .ci/run runs them in a step of their own, keeping
# the default run under 15 minutes.
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def test_a_pool_over_two_nodes_trains_like_one_process(cluster):
    pools = {"train": Pool(nodes=2, workers_per_node=1), "gen": Pool(nodes=1)}
    with rb.placement.Ray(
        address=cluster.address, pools=pools, roles={"rollout": "gen"}
    ) as placement:
        policy = placement.build("actor", policy_factory())
        engine = placement.build(
            "rollout", rb.rollout.HFEngine.from_pretrained, "tiny", progress=False
        )
        nodes = policy.nodes()
        assert len(set(nodes)) == 2  # STRICT_SPREAD: one worker per node
        local_policy, local_engine = local_blocks()
        ro, advantages = grpo_batch(local_engine, 0)
        local = local_policy.step(ro, advantages, loss_fn=LOSS)
        remote = policy.step(ro, advantages, loss_fn=LOSS)  # gloo across the two nodes
        assert remote["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-9)
        # Split layout: the engine has its own pool; weights go through the object store.
        metrics = rb.resharder.Resharder(bucket_mb=0.1).sync(policy, engine)
        engine_weights = engine.model.state_dict()
        n_bytes = sum(v.numel() * 8 for v in engine_weights.values())  # float64, one engine
        assert metrics["sync/bytes"] == n_bytes
        for name, value in local_policy.named_weights():
            torch.testing.assert_close(engine_weights[name], value.float(), rtol=1e-6, atol=1e-7)
        fresh = engine.generate(
            PROMPTS, group_size=2, sampling=rb.SamplingParams(max_new_tokens=6, seed=1)
        )
        gap = (fresh.rollout_logprobs - policy.logprobs(fresh))[fresh.response_mask].abs().max()
        assert gap < 1e-5
