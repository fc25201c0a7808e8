"""GRPO, written only with public blocks: read it, copy it, change it.

One step (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, sec. 4):

1. sample G responses for each of P prompts with the current policy;
2. score them with the reward function;
3. advantage = reward standardized within its group (no critic);
4. update the policy with the clipped surrogate, several mini-batches if asked;
5. push the new weights into the rollout engine.

Simplifications: the reference-policy KL term is left out by default (DAPO and Dr.GRPO drop it
too; pass a loss that takes ``ref_logprobs``, e.g. `rlblocks.losses.kl_regularized`, to add it
back), and every step draws fresh prompts. The loop around the step (progress, ``time/*``,
``on_step``) is `rlblocks.recipes.loop`, shared by every recipe.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from rlblocks import resharder as resharders
from rlblocks.advantage import grpo as grpo_advantage
from rlblocks.checkpoint import Checkpointer, Resume
from rlblocks.interfaces import (
    AdvantageEstimator,
    PolicyLoss,
    PolicyTrainer,
    Resharder,
    RewardFn,
    RolloutEngine,
    SamplingParams,
)
from rlblocks.recipes.defaults import (
    DEFAULT_SAMPLING,
    PPO_CLIP,
    StepCallback,
)
from rlblocks.recipes.loop import Clock, Step, Tracker, run_config, run_steps
from rlblocks.recipes.overlap import OneStepOff, Sampled
from rlblocks.rewards import checked


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
    reuse_rollout_logprobs: bool | None = None,
    async_rollout: OneStepOff | None = None,
    progress: bool = True,
    checkpoint: Checkpointer | str | Path | None = None,
    resume: Resume = False,
    tracker: Tracker | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` GRPO steps; returns one metrics dict per step.

    ``reuse_rollout_logprobs`` takes the engine's sampling log-probs as π_old instead of
    recomputing them with the trainer: one forward pass less per step, exact only when the
    engine samples with the trainer's current weights at the trainer's temperature. None (the
    default) does so exactly then: an in-process `HFEngine` around ``policy.model``
    (`rlblocks.recipes.defaults.samples_with_policy`); True forces it, False never.

    ``async_rollout``: a `rlblocks.recipes.OneStepOff` samples the next batch while the
    trainer updates on this one (one update stale; the engine needs its own copy of the
    weights), with π_old recomputed or taken from the engine as it says; see
    `rlblocks.recipes.overlap`. Its metrics: ``async/staleness``, ``async/sample_seconds``.

    ``batches`` yields prompt batches with ``.prompts`` and ``.metadata`` (see
    :mod:`rlblocks.data`). ``on_step(step, metrics, rollouts)`` is called after every step:
    log, plot, checkpoint or stop there (raise ``StopIteration`` to end early).

    Metrics: the reward function's (``reward/mean``), the trainer's, the resharder's, and the
    ones every recipe reports (`rlblocks.recipes.loop`): ``time/rollout``, ``time/reward``,
    ``time/logprobs``, ``time/update``, ``time/sync``, ``step_seconds``, ``response_length``,
    and ``kl/token`` when the loss has a KL term.

    ``checkpoint`` (a `rlblocks.checkpoint.Checkpointer` or a folder), ``resume`` (False, True or
    ``"auto"``) and ``tracker`` (`rlblocks.tracking.Tracker`): the run is saved after every
    ``checkpoint.every`` steps and goes on from there, bit for bit; see
    `rlblocks.recipes.loop.run_steps` and docs/checkpoints.md.
    """
    config = run_config("grpo", locals())  # logged once, checked on resume
    resharder = resharder or resharders.Resharder()
    reward_fn = checked(reward_fn)  # the RewardFn contract; a NaN/inf row gets 0.0, counted
    sampled = Sampled(  # 1., in the step or one step ahead (async_rollout), and π_old's source
        engine,
        policy,
        group_size=group_size,
        sampling=sampling,
        overlap=async_rollout,
        reuse_rollout_logprobs=reuse_rollout_logprobs,
    )

    def step(index: int, batches: Iterator[Any], clock: Clock) -> Step | None:
        # 1. G samples per prompt, one group id per prompt (the next batch too, when async)
        drawn = sampled.next(batches, clock, ahead=index + 1 < steps)
        if drawn is None:
            return None  # the prompt batches ran out
        rollouts, async_metrics = drawn
        with clock("reward"):  # 2. one scalar per response
            rewards, reward_metrics = reward_fn(rollouts)
        rollouts = rollouts.replace(rewards=rewards)  # kept with the rows (dashboards read it)
        advantages, _ = advantage(rewards, rollouts.response_mask, rollouts.group_ids)  # 3.
        rollouts = sampled.with_old_logprobs(rollouts)  # π_old: the engine's, if so chosen
        with clock("update"):  # 4. (π_old scored inside: the trainer's logprob_seconds)
            train_metrics = policy.step(rollouts, advantages, loss_fn=loss_fn)
        sampled.wait(clock)  # the batch sampled ahead is complete: the engine is idle
        with clock("sync"):  # 5.
            sync_metrics = resharder.sync(policy, engine)
        metrics = {**reward_metrics, **train_metrics, **sync_metrics, **async_metrics}
        return Step(metrics, rollouts)

    try:
        return run_steps(
            "GRPO",
            step,
            batches,
            batch_per_step=False,  # the step draws its batch, and the next one when async
            steps=steps,
            on_step=on_step,
            progress=progress,
            blocks={"policy": policy, "resharder": resharder, "rollouts": sampled},
            config=config,
            checkpoint=checkpoint,
            resume=resume,
            after_resume=partial(resharder.resync, policy, engine),  # it has initial weights
            tracker=tracker,
        )
    finally:
        sampled.close()
