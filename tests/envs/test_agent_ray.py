"""`AgentEngine` around an engine placed on a Ray worker: the same episodes as in this process,
and the resharder's weights reach the worker through the wrapper."""

from __future__ import annotations

import pytest
import torch
from agent_cases import PROMPTS, SAMPLING, ScriptedEnv
from builders import tiny_trainer

import rlblocks as rb
from rlblocks.envs import AgentEngine

pytestmark = pytest.mark.ray


def test_agent_engine_over_a_ray_placed_engine():
    placement = rb.placement.Ray(workers=1)
    try:
        remote = placement.build(
            "rollout", rb.rollout.HFEngine.from_pretrained, "tiny", chat=True, progress=False
        )
        agent = AgentEngine(remote, ScriptedEnv(turns=2), max_total_tokens=256)
        assert agent.model is None  # nothing fetched from the worker
        ro = agent.generate(PROMPTS, group_size=2, sampling=SAMPLING)
        # The same weights ("tiny") and seeds in this process give the same rows, bit for bit
        # (one worker: its rank adds 0 to the seed).
        local_engine = rb.rollout.HFEngine.from_pretrained("tiny", chat=True, progress=False)
        local = AgentEngine(local_engine, ScriptedEnv(turns=2), max_total_tokens=256)
        expected = local.generate(PROMPTS, group_size=2, sampling=SAMPLING)
        assert torch.equal(ro.response_ids, expected.response_ids)
        assert torch.equal(ro.response_mask, expected.response_mask)
        assert torch.equal(ro.rollout_logprobs, expected.rollout_logprobs)
        assert [m["agent"]["end"] for m in ro.metadata] == [
            m["agent"]["end"] for m in expected.metadata
        ]
        # A sync through the wrapper reaches the worker's engine.
        policy = tiny_trainer()
        policy.step(ro, torch.linspace(-1, 1, len(ro)), loss_fn=rb.losses.clipped_surrogate)
        metrics = rb.resharder.Resharder().sync(policy, agent)
        assert metrics["sync/bytes"] > 0
        after = remote.model.state_dict()  # rank 0's engine
        for name, value in policy.model.state_dict().items():
            assert torch.equal(after[name], value), name
    finally:
        placement.shutdown()
