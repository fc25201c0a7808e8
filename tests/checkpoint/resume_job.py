"""A small run that checkpoints, for the resume tests; run as a script in its own process:

    python resume_job.py RECIPE OUT STEPS [--resume] [--every N] [--fsize-limit BYTES]
                         [--hang-in-save STEP]

RECIPE is grpo (an engine with its own copy of the weights, synced by the resharder; a KL loss
to the reference), ppo (a critic and an adaptive KL controller) or dapo (dynamic sampling over
epoch boundaries). The tiny model, the toy "Count: i" task, checkpoints in OUT/checkpoints.
Prints ``STEP i`` after each step; logs metrics.jsonl and samples.jsonl in OUT (a Tracker); at
the end writes OUT/result.pt: the history and the final weights of the policy (and critic).

``--fsize-limit``: after the checkpoint of step 1, limit the size of any file this process writes
(RLIMIT_FSIZE), with SIGXFSZ ignored so that a write past it fails with EFBIG as a full disk
would. ``--hang-in-save STEP``: a block that prints ``SAVING`` and sleeps while the checkpoint
of STEP is being written (for a kill in the middle of a save).
"""

from __future__ import annotations

import argparse
import resource
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: builders, toy_tasks

import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import count_prompts, digit_fraction

import rlblocks as rb
from rlblocks.data import PromptBatches


class HangingBatches(PromptBatches):
    """Prompt batches whose position, asked for by the checkpoint of step ``hang_at`` (the
    ``hang_at + 1``-th save, after those of steps 0 to ``hang_at - 1``), is given only after a
    long sleep: a save stuck half-way."""

    def __init__(self, *args, hang_at: int | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hang_at, self.saves = hang_at, 0

    def state_dict(self) -> dict:
        self.saves += 1
        if self.hang_at is not None and self.saves == self.hang_at + 1:
            print("SAVING", flush=True)
            time.sleep(600)
        return super().state_dict()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("recipe", choices=("grpo", "ppo", "dapo"))
    p.add_argument("out", type=Path)
    p.add_argument("steps", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--fsize-limit", type=int)
    p.add_argument("--hang-in-save", type=int)
    args = p.parse_args()
    torch.manual_seed(0)
    policy = tiny_trainer(reference="copy", mini_batch_size=16, epochs=2)
    critic = None
    ckpt = rb.checkpoint.Checkpointer(args.out / "checkpoints", every=args.every)

    def on_step(index, metrics, rollouts) -> None:
        print(f"STEP {index}", flush=True)
        if args.fsize_limit and index == 1:  # after the checkpoint of step 1, before step 2
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))

    common = {
        "steps": args.steps,
        "sampling": rb.SamplingParams(max_new_tokens=8),
        "run": rb.run.RunOptions(
            on_step=on_step,
            progress=False,
            checkpoint=ckpt,
            resume=args.resume,
            # metrics.jsonl, samples.jsonl
            tracker=rb.tracking.Tracker(args.out, samples_every=2),
        ),
    }
    reward = rb.rewards.per_sample(digit_fraction, timeout=None)
    data = HangingBatches(count_prompts(), prompts_per_step=4, seed=0, hang_at=args.hang_in_save)
    shared = tiny_engine(policy)
    if args.recipe == "grpo":
        engine = tiny_engine(policy, shared=False)  # its own copy of the weights
        loss = rb.losses.kl_regularized(rb.recipes.defaults.PPO_CLIP, kl_coef=0.1)
        history = rb.recipes.grpo(
            policy, engine, reward, data, group_size=8, loss_fn=loss, **common
        )
    elif args.recipe == "ppo":
        critic = rb.critic.CriticTrainer(policy.model, lr=1e-3)
        history = rb.recipes.ppo(
            policy,
            critic,
            shared,
            reward,
            data,
            group_size=4,
            kl_controller=rb.losses.AdaptiveKLController(0.05, target=0.01, horizon=100),
            **common,
        )
    else:
        history = rb.recipes.dapo(
            policy, shared, reward, data, group_size=4, groups_per_step=3, **common
        )
    result = {"history": history, "policy": policy.model.state_dict()}
    if critic is not None:
        result["critic"] = critic.model.state_dict()
    torch.save(result, args.out / "result.pt")


if __name__ == "__main__":
    main()
