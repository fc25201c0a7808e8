"""Online DPO, written only with public blocks: read it, copy it, change it.

One step (Guo et al. 2024, arXiv 2402.04792; TRL's ``OnlineDPOTrainer``): two responses per
prompt from the current policy, ranked by any reward (`rlblocks.losses.ranked_pairs`; a tie is
no preference), DPO's loss on the pairs against the trainer's reference, reaching the per-token
update as advantages A = −(n/P)·∂ΣL/∂log π at π_old (`rlblocks.losses.preference_advantages`):
its first optimizer step follows ∇ of the mean pair loss exactly. ``preference=`` swaps the loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

import rlblocks.recipes.defaults as defaults  # noqa: PLR0402 (no import of the package)
from rlblocks.interfaces import PolicyLoss, PolicyTrainer, RewardFn, RolloutEngine, SamplingParams
from rlblocks.losses import PreferenceLoss, dpo, preference_advantages, ranked_pairs, uses_reference
from rlblocks.recipes.names import RECIPES
from rlblocks.rewards import checked
from rlblocks.run import RolloutSource, Run, RunOptions, run_config


@RECIPES.register("online_dpo")
def online_dpo(
    policy: PolicyTrainer,
    engine: RolloutEngine,
    reward_fn: RewardFn,
    batches: Iterable[Any],
    *,
    steps: int,
    preference: PreferenceLoss = dpo,
    loss_fn: PolicyLoss = defaults.PPO_CLIP,
    group_size: int = 2,
    sampling: SamplingParams = defaults.DEFAULT_SAMPLING,
    run: RunOptions | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` online-DPO steps (``group_size`` > 2: best against worst; below 2 is
    refused: no pair could form); one
    metrics dict per step: the reward's, ``preference/*`` (at π_old), ``dpo/pairs`` (untied
    pairs trained on), the trainer's and resharder's. ``run`` and the rest as in
    `rlblocks.recipes.grpo`."""
    config = run_config("online_dpo", locals())
    run = Run("online_dpo", steps=steps, blocks={"policy": policy}, config=config, options=run)
    if group_size < 2:  # ranked_pairs needs two responses to a prompt
        raise ValueError(
            f"online_dpo: group_size={group_size} samples one response per prompt, so no pair "
            "can form and no step would train; pass group_size >= 2 (2: one pair per prompt)"
        )
    reward_fn = checked(reward_fn)
    anchored = uses_reference(preference)  # SimPO needs no π_ref
    source = RolloutSource(engine, policy, batches, run, group_size=group_size, sampling=sampling)
    loss_fn = source.corrected(loss_fn)  # RunOptions.correction: for stale rows (k steps off)
    with run.driving(source):
        for step in run:
            rollouts = source.draw()  # 1. responses from the current policy
            with run.phase("reward"):  # 2. ranked: the best and the worst of each prompt
                rewards, metrics = reward_fn(rollouts)
            rollouts = rollouts.replace(rewards=rewards)
            chosen, rejected = ranked_pairs(rewards, rollouts.group_ids)
            metrics["dpo/pairs"] = float(len(chosen))
            if not len(chosen):  # every pair tied: nothing to learn this step
                run.record(metrics, rollouts)
                continue
            pairs = rollouts.select(torch.stack([chosen, rejected], 1).flatten())  # c0 r0 c1 r1
            pairs = source.with_old_logprobs(pairs)  # 3. π_old and π_ref of the paired rows
            with run.phase("logprobs"):
                ref = policy.ref_logprobs(pairs) if anchored else None
            p = torch.arange(len(chosen))
            scale = float(policy.normalizer(pairs)) / len(chosen)  # the trainer divides by n
            assert pairs.old_logprobs is not None  # with_old_logprobs set it
            advantages, pair_metrics = preference_advantages(  # 4. DPO's gradient, per token
                preference,
                pairs.old_logprobs,
                ref,
                pairs.response_mask,
                2 * p,
                2 * p + 1,
                scale=scale,
            )
            metrics |= {k: float(v) for k, v in pair_metrics.items()}
            with run.phase("update"):
                metrics |= policy.step(pairs, advantages, loss_fn=loss_fn)
            metrics |= source.sync()  # 5. the engine samples with the new weights
            run.record(metrics, rollouts)
    return run.history


__all__ = ["online_dpo"]
