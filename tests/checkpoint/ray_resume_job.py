"""A GRPO run on a Ray placement that checkpoints, for test_resume_ray.py; run as a script in its
own process (the driver), which starts and stops its own local Ray instance:

    python ray_resume_job.py OUT STEPS --workers N [--engine driver|workers] [--resume]

The policy is FSDP2-sharded over the pool's N workers (float32, unsharded when N is 1), with a
KL loss to its frozen reference. ``--engine driver``: the rollout engine lives in this process
with its own copy of the weights, synced from the workers by the resharder, and samples with
this process's generator (saved in the checkpoint's ``state.json``), so the rollouts do not depend
on N. ``--engine workers``: an engine in every worker (colocated with the policy's shards)
samples that worker's share of the prompts with that worker's generator (saved per rank with
the policy, ``rng-{rank}.json``). The toy "Count: i" task, checkpoints in OUT/checkpoints. Prints
``STEP i`` after each step; at the end writes OUT/result.pt: the history and the final weights.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: builders, toy_tasks

import builders
import torch
from builders import tiny_trainer
from ray import cloudpickle
from toy_tasks import count_prompts, digit_fraction

import rlblocks as rb
from rlblocks.data import PromptBatches

# The factories below travel to the workers by value (cloudpickle pickles functions of
# __main__ so); the workers import rlblocks from the PYTHONPATH they inherit from this process
# through the local Ray instance it starts (test_resume_ray.py sets it to the tested checkout).
# Their sys.path lacks tests/: builders goes by value too.
cloudpickle.register_pickle_by_value(builders)
SAMPLING = rb.SamplingParams(max_new_tokens=8)


def policy() -> rb.trainer.PolicyTrainer:
    return tiny_trainer(reference="copy", mini_batch_size=16, epochs=2)


def colocated_engine() -> rb.rollout.HFEngine:
    """An engine in a worker; each rank's generator seeded apart (the same seed would give
    every rank the same noise)."""
    import torch.distributed as dist

    torch.manual_seed(1 + dist.get_rank())
    model, tokenizer = rb.models.tiny(seed=0)
    return rb.rollout.HFEngine(model, tokenizer, progress=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("steps", type=int)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--engine", choices=("driver", "workers"), default="driver")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    with rb.placement.Ray(workers=args.workers) as placement:
        trainer = placement.build("actor", policy)
        if args.engine == "workers":
            engine = placement.build("rollout", colocated_engine)
        else:
            model, tokenizer = rb.models.tiny(seed=0)
            engine = rb.rollout.HFEngine(copy.deepcopy(model), tokenizer, progress=False)
        history = rb.recipes.grpo(
            trainer,
            engine,
            rb.rewards.per_sample(digit_fraction, timeout=None),
            PromptBatches(count_prompts(), prompts_per_step=4, seed=0),
            steps=args.steps,
            group_size=8,
            sampling=SAMPLING,
            loss_fn=rb.losses.kl_regularized(rb.recipes.defaults.PPO_CLIP, kl_coef=0.1),
            run=rb.run.RunOptions(
                on_step=lambda index, metrics, rollouts: print(f"STEP {index}", flush=True),
                progress=False,
                checkpoint=rb.checkpoint.Checkpointer(args.out / "checkpoints"),
                resume=args.resume,
            ),
        )
        weights = dict(trainer.named_weights())
    torch.save({"history": history, "policy": weights}, args.out / "result.pt")


if __name__ == "__main__":
    main()
