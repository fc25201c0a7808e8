"""GRPO, written only with public blocks: read it, copy it, change it.

One step (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, sec. 4):

1. sample G responses for each of P prompts with the current policy;
2. score them with the reward function;
3. advantage = reward standardized within its group (no critic);
4. update the policy with the clipped surrogate, several mini-batches if asked;
5. push the new weights into the rollout engine.

Simplifications: the reference-policy KL term is left out by default (DAPO and Dr.GRPO drop it
too; pass a loss that takes ``ref_logprobs`` to add it back), and every step draws fresh prompts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from tqdm.auto import tqdm

from rlblocks import resharder as resharders
from rlblocks.advantage import grpo as grpo_advantage
from rlblocks.interfaces import (
    AdvantageEstimator,
    PolicyLoss,
    PolicyTrainer,
    Resharder,
    RewardFn,
    RolloutEngine,
    Rollouts,
    SamplingParams,
)
from rlblocks.losses import clipped_surrogate

StepCallback = Callable[[int, dict[str, Any], Rollouts], None]

DEFAULT_SAMPLING = SamplingParams(max_new_tokens=128)
PPO_CLIP = partial(clipped_surrogate, clip=(0.2, 0.2))


def grpo(
    policy: PolicyTrainer,
    engine: RolloutEngine,
    reward_fn: RewardFn,
    batches: Iterable[Any],
    *,
    steps: int,
    group_size: int = 8,
    sampling: SamplingParams = DEFAULT_SAMPLING,
    advantage: AdvantageEstimator = grpo_advantage,
    loss_fn: PolicyLoss = PPO_CLIP,
    resharder: Resharder | None = None,
    on_step: StepCallback | None = None,
    reuse_rollout_logprobs: bool = False,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run ``steps`` GRPO steps; returns one metrics dict per step.

    ``reuse_rollout_logprobs`` takes the engine's sampling log-probs as π_old instead of
    recomputing them with the trainer: one forward pass less per step, exact only when the
    engine samples with the trainer's current weights at the trainer's temperature (the
    in-process HF engine sharing the model does).

    ``batches`` yields prompt batches with ``.prompts`` and ``.metadata`` (see
    :mod:`rlblocks.data`). ``on_step(step, metrics, rollouts)`` is called after every step:
    log, plot, checkpoint or stop there (raise ``StopIteration`` to end early).
    """
    resharder = resharder or resharders.Resharder()
    history: list[dict[str, Any]] = []
    bar = tqdm(total=steps, desc="GRPO", disable=not progress, unit="step")
    for step, batch in zip(range(steps), batches, strict=False):
        start = time.perf_counter()
        rollouts = engine.generate(  # 1. G samples per prompt, one group id per prompt
            batch.prompts, n=group_size, sampling=sampling, metadata=batch.metadata
        )
        generated = time.perf_counter()  # a colocated vLLM engine sleeps by itself now
        rewards, reward_metrics = reward_fn(rollouts)  # 2. one scalar per response
        rewarded = time.perf_counter()
        rollouts = rollouts.replace(rewards=rewards)  # kept with the rows (dashboards read it)
        advantages, _ = advantage(rewards, rollouts.response_mask, rollouts.group_ids)  # 3.
        if reuse_rollout_logprobs:
            rollouts = rollouts.replace(old_logprobs=rollouts.rollout_logprobs)
        train_metrics = policy.step(rollouts, advantages, loss_fn=loss_fn)  # 4.
        sync_metrics = resharder.sync(policy, engine)  # 5.
        metrics = {
            **reward_metrics,
            **train_metrics,
            **sync_metrics,
            "response_length": rollouts.response_lengths.float().mean().item(),
            "step_seconds": time.perf_counter() - start,
            **_breakdown(generated - start, rewarded - generated, train_metrics, sync_metrics),
        }
        history.append(metrics)
        bar.update()
        bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
        if on_step is not None:
            try:
                on_step(step, metrics, rollouts)
            except StopIteration:
                break
    bar.close()
    return history


def _breakdown(
    rollout: float, reward: float, train: dict[str, Any], sync: dict[str, Any]
) -> dict[str, float]:
    """Where a step's seconds went: ``time/rollout``, ``reward``, ``logprobs``, ``update``,
    ``sync`` (the last three from the trainer's and the resharder's own metrics)."""
    logprobs = float(train.get("logprob_seconds", 0.0))
    return {
        "time/rollout": rollout,
        "time/reward": reward,
        "time/logprobs": logprobs,
        "time/update": float(train.get("seconds", 0.0)) - logprobs,
        "time/sync": float(sync.get("sync/seconds", 0.0)),
    }
