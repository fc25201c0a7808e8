"""Supervised fine-tuning on the same `PolicyTrainer` as RL: read it, copy it, change it.

One step: a batch of tokenized examples (`rlblocks.data.SFTBatches`: prompt in ``prompt_ids``,
target in ``response_ids``, ``response_mask`` True on the tokens to learn), one
``policy.step`` with the per-token negative log-likelihood (`rlblocks.losses.nll`). Nothing
else: the trainer's micro-batches (``micro_batch_size`` rows or ``micro_batch_tokens`` real
tokens, rows of similar length together), gradient clipping, NaN guard, schedule, checkpoints
and data-parallel split are the RL update's. The trainer that comes out is the one GRPO goes
on with (``python -m rlblocks --sft-steps 20``; docs/sft.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rlblocks.base.masked import masked_mean
from rlblocks.interfaces import PolicyLoss, PolicyTrainer, Rollouts
from rlblocks.losses import nll
from rlblocks.run import Batches, Run, RunOptions, run_config


def sft(
    policy: PolicyTrainer,
    batches: Iterable[Rollouts],
    *,
    steps: int,
    loss_fn: PolicyLoss = nll,
    held_out: Rollouts | None = None,
    eval_every: int = 0,
    run: RunOptions | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` SFT steps, one optimizer step per batch unless the trainer's
    ``mini_batch_size`` cuts it; returns one metrics dict per step.

    ``batches`` yields `Rollouts` (`rlblocks.data.SFTBatches`). ``held_out``: examples scored
    every ``eval_every`` steps and after the last one (``eval/nll``, `held_out_nll`; 0: only
    after the last). Metrics: the trainer's (``loss``, ``nll``, ``grad_norm``, ``lr``, ...),
    ``tokens`` (target tokens in the batch), the loop's ``time/*`` (the update is
    ``time/update``). ``run`` (on_step, progress, checkpoint, resume, tracker): as in
    `rlblocks.recipes.grpo`; nothing is sampled, so its rollout options do not apply. The
    trainer's ``temperature`` divides the logits here too: keep it at 1 (the default) for the
    usual likelihood.
    """
    config = run_config("sft", locals())
    run = Run("sft", steps=steps, blocks={"policy": policy}, config=config, options=run)
    source = Batches(batches)
    with run.driving(source):
        for step in run:
            batch = source.draw()  # the run ends when the batches run out
            # No advantage, no π_old in maximum likelihood: zeros spare the trainer a scoring
            # pass.
            zeros = torch.zeros(batch.response_ids.shape)
            with run.phase("update"):
                metrics = policy.step(batch.replace(old_logprobs=zeros), zeros, loss_fn=loss_fn)
            metrics["tokens"] = int(batch.response_mask.sum())
            last = step + 1 == steps
            if held_out is not None and (last or (eval_every and (step + 1) % eval_every == 0)):
                with run.phase("logprobs"):
                    metrics["eval/nll"] = held_out_nll(policy, held_out)
            run.record(metrics, batch)
    return run.history


def held_out_nll(policy: PolicyTrainer, examples: Rollouts) -> float:
    """Mean −log π_θ over the target tokens of ``examples`` (``response_mask``), no gradient:
    the token-mean SFT loss on data the update does not see."""
    logprobs = policy.logprobs(examples)
    return float(masked_mean(-logprobs.float().cpu(), examples.response_mask.cpu()))


__all__ = ["held_out_nll", "sft"]
