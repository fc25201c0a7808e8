"""The Ray + FSDP2 + HF engine path on NCCL, when a CUDA device and Ray are both present.

Never in CI (no GPU), nor on the GPU machines this project borrows (no Ray there): the
trainer's own GPU paths are tests/trainer/test_gpu.py. One worker shards only because the
trainer asks for it (``fsdp=FSDP()``): a pool of one keeps a model whole otherwise, so this
really runs FSDP2 at world size 1 on NCCL.
"""

import pytest
import torch
from ray_helpers import LOSS, PROMPTS, grpo_batch, local_blocks

import rlblocks as rb
from rlblocks.placement import Pool

pytestmark = [
    pytest.mark.ray,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_one_gpu_worker_trains_like_one_process_and_syncs():
    pools = {"default": Pool(workers_per_node=1, gpus_per_worker=1)}
    with rb.placement.Ray(pools=pools) as placement:
        policy = placement.build(
            "actor",
            rb.trainer.PolicyTrainer.from_pretrained,
            "tiny",
            device="cuda",
            lr=1e-3,
            reference=None,
            fsdp=rb.trainer.FSDP(),
        )
        engine = placement.build(
            "rollout", rb.rollout.HFEngine.from_pretrained, "tiny", device="cuda", progress=False
        )
        local_policy, local_engine = local_blocks()
        ro, advantages = grpo_batch(local_engine, 0)
        local = local_policy.step(ro, advantages, loss_fn=LOSS)
        remote = policy.step(ro, advantages, loss_fn=LOSS)
        # float32 on a GPU against float64 on the CPU: TF32-free float32 matmuls, ~1e-6.
        assert remote["grad_norm"] == pytest.approx(local["grad_norm"], rel=1e-4)
        rb.resharder.Resharder().sync(policy, engine)
        fresh = engine.generate(
            PROMPTS, group_size=2, sampling=rb.SamplingParams(max_new_tokens=6, seed=1)
        )
        gap = (fresh.rollout_logprobs - policy.logprobs(fresh))[fresh.response_mask].abs().max()
        assert gap < 1e-4
