"""Online DPO, written only with public blocks: read it, copy it, change it.

One step (Guo et al. 2024, arXiv 2402.04792; TRL's ``OnlineDPOTrainer``): two responses per
prompt from the current policy, ranked by any reward (`rlblocks.losses.ranked_pairs`; a tie is
no preference), DPO's loss on the pairs against the trainer's reference, reaching the per-token
update as advantages A = −(n/P)·∂ΣL/∂log π at π_old (`rlblocks.losses.preference_advantages`):
its first optimizer step follows ∇ of the mean pair loss exactly. ``preference=`` swaps the loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

import rlblocks.recipes.defaults as defaults  # noqa: PLR0402 (no import of the package)
from rlblocks import resharder as resharders
from rlblocks.checkpoint import Checkpointer, Resume
from rlblocks.interfaces import PolicyLoss, PolicyTrainer, RewardFn, RolloutEngine, SamplingParams
from rlblocks.losses import PreferenceLoss, dpo, preference_advantages, ranked_pairs, uses_reference
from rlblocks.recipes.loop import Clock, Step, Tracker, run_config, run_steps
from rlblocks.rewards import checked


def online_dpo(
    policy: PolicyTrainer,
    engine: RolloutEngine,
    reward_fn: RewardFn,
    batches: Iterable[Any],
    *,
    steps: int,
    preference: PreferenceLoss = dpo,
    samples_per_prompt: int = 2,
    sampling: SamplingParams = defaults.DEFAULT_SAMPLING,
    loss_fn: PolicyLoss = defaults.PPO_CLIP,
    resharder: resharders.Resharder | None = None,
    reuse_rollout_logprobs: bool | None = None,
    on_step: defaults.StepCallback | None = None,
    progress: bool = True,
    checkpoint: Checkpointer | str | Path | None = None,
    resume: Resume = False,
    tracker: Tracker | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` online-DPO steps (``samples_per_prompt`` > 2: best against worst); one
    metrics dict per step: the reward's, ``preference/*`` (at π_old), ``dpo/pairs`` (untied
    pairs trained on), the trainer's and resharder's. The rest as in `rlblocks.recipes.grpo`."""
    config = run_config("online_dpo", locals())
    resharder, reward_fn = resharder or resharders.Resharder(), checked(reward_fn)
    reuse = defaults.reuses_rollout_logprobs(reuse_rollout_logprobs, policy, engine, sampling)
    anchored = uses_reference(preference)  # SimPO needs no π_ref

    def step(index: int, batch: Any, clock: Clock) -> Step:
        with clock("rollout"):  # 1. responses from the current policy
            rollouts = engine.generate(
                batch.prompts, n=samples_per_prompt, sampling=sampling, metadata=batch.metadata
            )
        with clock("reward"):  # 2. ranked: the best and the worst of each prompt
            rewards, metrics = reward_fn(rollouts)
        rollouts = rollouts.replace(rewards=rewards)
        chosen, rejected = ranked_pairs(rewards, rollouts.group_ids)
        metrics["dpo/pairs"] = float(len(chosen))
        if not len(chosen):
            return Step(metrics, rollouts)  # every pair tied: nothing to learn this step
        pairs = rollouts.select(torch.stack([chosen, rejected], 1).flatten())  # c0 r0 c1 r1 …
        with clock("logprobs"):  # 3. π_old and π_ref of the paired rows
            old = pairs.rollout_logprobs if reuse else policy.logprobs(pairs)
            ref = policy.ref_logprobs(pairs) if anchored else None
        pairs, p = pairs.replace(old_logprobs=old), torch.arange(len(chosen))
        scale = float(policy.normalizer(pairs)) / len(chosen)  # the trainer divides by n
        advantages, pair_metrics = preference_advantages(  # 4. DPO's gradient, per token
            preference, old, ref, pairs.response_mask, 2 * p, 2 * p + 1, scale=scale
        )
        metrics |= {k: float(v) for k, v in pair_metrics.items()}
        with clock("update"):
            metrics |= policy.step(pairs, advantages, loss_fn=loss_fn)
        with clock("sync"):  # 5. the engine samples with the new weights
            metrics |= resharder.sync(policy, engine)
        return Step(metrics, rollouts)

    return run_steps(
        "online DPO",
        step,
        batches,
        steps=steps,
        on_step=on_step,
        progress=progress,
        blocks={"policy": policy, "resharder": resharder},
        config=config,
        checkpoint=checkpoint,
        resume=resume,
        after_resume=lambda: resharder.resync(policy, engine),
        tracker=tracker,
    )


__all__ = ["online_dpo"]
