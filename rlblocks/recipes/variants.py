"""GRPO-family variants. Most are one keyword of `rlblocks.recipes.grpo`; ReMax needs one more
generation per step, so it gets this short recipe.

The one-keyword variants (see docs/algorithms/variants.md)::

    grpo(..., advantage=rb.advantage.rloo)                          # RLOO
    grpo(..., advantage=rb.advantage.reinforce_pp_baseline)         # REINFORCE++-baseline
    grpo(..., advantage=partial(rb.advantage.grpo, scale_by_std=False))   # Dr.GRPO, with a
    # trainer built with aggregation=rb.losses.SeqMeanTokenSumNorm(max_tokens=max_new_tokens)

ReMax (Li et al. 2023, arXiv 2310.10505) subtracts the reward of the *greedy* response to the
same prompt. The GRPO recipe calls ``advantage(rewards, mask, group_ids)``, which cannot
generate, so `remax` is the GRPO loop with one line more: `greedy_baseline_rewards` (generate
greedily, score, give each row its prompt's score) feeding ``rb.advantage.remax``'s
``baseline_rewards=``. The loop around the step (progress, ``time/*``, ``on_step``) is
`rlblocks.recipes.loop`, shared by every recipe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlblocks import resharder as resharders
from rlblocks.advantage import remax as remax_advantage
from rlblocks.checkpoint import Checkpointer, Resume
from rlblocks.interfaces import (
    PolicyLoss,
    PolicyTrainer,
    Resharder,
    RewardFn,
    RewardOutput,
    RolloutEngine,
    Rollouts,
    SamplingParams,
)
from rlblocks.recipes.defaults import DEFAULT_SAMPLING, PPO_CLIP, StepCallback
from rlblocks.recipes.loop import Clock, Step, Tracker, run_config, run_steps
from rlblocks.rewards import checked


def greedy_baseline_rewards(
    engine: RolloutEngine,
    reward_fn: RewardFn,
    rollouts: Rollouts,
    batch: Any,
    *,
    sampling: SamplingParams,
) -> RewardOutput:
    """ReMax's baseline (Li et al. 2023, arXiv 2310.10505, Algorithm 1, line 5): the reward of
    the greedy response ȳ to each row's prompt x.

        bᵢ = r(x(i), ȳ(x(i))),   ȳ(x) = argmax decoding of x (temperature 0)

    ``batch`` (``.prompts``, ``.metadata``) holds the prompts ``rollouts`` were sampled from;
    each is answered once, greedily, with ``sampling``'s other settings (``max_new_tokens``,
    ``stop``). Rows are matched to their prompt by the rendered prompt text
    (``rollouts.prompts``), so the engine may order rows as it likes; equal prompts share a
    greedy answer anyway. Returns `RewardOutput(rewards (b) float32, metrics)`, no gradient;
    ``reward_fn``'s metrics are renamed ``"baseline/…"``.
    """
    greedy_sampling = dataclasses.replace(sampling, temperature=0.0)
    greedy = engine.generate(batch.prompts, n=1, sampling=greedy_sampling, metadata=batch.metadata)
    greedy_rewards, metrics = reward_fn(greedy)  # (p) one per prompt
    prompt_of = {text: i for i, text in enumerate(greedy.prompts)}
    missing = sorted(set(rollouts.prompts) - set(prompt_of))
    if missing:
        raise ValueError(f"greedy_baseline_rewards: no greedy answer for the prompt {missing[0]!r}")
    rows = torch.tensor([prompt_of[text] for text in rollouts.prompts], dtype=torch.long)
    renamed = {f"baseline/{k.removeprefix('reward/')}": float(v) for k, v in metrics.items()}
    return RewardOutput(greedy_rewards.detach().float().cpu()[rows], renamed)


def remax(
    policy: PolicyTrainer,
    engine: RolloutEngine,
    reward_fn: RewardFn,
    batches: Iterable[Any],
    *,
    steps: int,
    group_size: int = 1,
    sampling: SamplingParams = DEFAULT_SAMPLING,
    loss_fn: PolicyLoss = PPO_CLIP,
    resharder: Resharder | None = None,
    on_step: StepCallback | None = None,
    progress: bool = True,
    checkpoint: Checkpointer | str | Path | None = None,
    resume: Resume = False,
    tracker: Tracker | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` ReMax steps; returns one metrics dict per step.

    ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models", arXiv 2310.10505, Algorithm 1):

        Aᵢ = r(x, yᵢ) − r(x, ȳ),   yᵢ ~ π_θ(·|x),  ȳ = greedy decoding of x

    The GRPO recipe's loop with the greedy baseline (`greedy_baseline_rewards`) passed to
    ``rb.advantage.remax(baseline_rewards=...)``. ``group_size`` samples per prompt (the paper
    uses 1; the baseline needs no group). One greedy generation per prompt per step more than
    GRPO, in exchange for no group statistics. Metrics: the reward's (``reward/mean``),
    ``baseline/…`` (the greedy answers'), the trainer's, the resharder's, and the ones every
    recipe reports (`rlblocks.recipes.loop`): ``time/*`` (the greedy generation is
    ``time/rollout``, its scoring ``time/reward``), ``step_seconds``, ``response_length`` and
    ``kl/token`` when the loss has a KL term. ``on_step``: as in `rlblocks.recipes.grpo`.

    ``checkpoint`` (a `rlblocks.checkpoint.Checkpointer` or a folder), ``resume`` (False, True or
    ``"auto"``) and ``tracker`` (`rlblocks.tracking.Tracker`): the run is saved after every
    ``checkpoint.every`` steps and goes on from there, bit for bit; see
    `rlblocks.recipes.loop.run_steps` and docs/checkpoints.md.
    """
    config = run_config("remax", locals())  # logged once, checked on resume
    resharder = resharder or resharders.Resharder()
    reward_fn = checked(reward_fn)  # the RewardFn contract; a NaN/inf row gets 0.0, counted

    def step(index: int, batch: Any, clock: Clock) -> Step:
        with clock("rollout"):
            rollouts = engine.generate(
                batch.prompts, n=group_size, sampling=sampling, metadata=batch.metadata
            )
        with clock("reward"):
            rewards, reward_metrics = reward_fn(rollouts)
        with clock("rollout"):  # the one extra line of ReMax: greedy answers, scored
            baseline, baseline_metrics = greedy_baseline_rewards(
                engine, clock.timed("reward", reward_fn), rollouts, batch, sampling=sampling
            )
        rollouts = rollouts.replace(rewards=rewards)  # kept with the rows (dashboards read it)
        advantages, _ = remax_advantage(
            rewards, rollouts.response_mask, rollouts.group_ids, baseline_rewards=baseline
        )
        with clock("update"):
            train_metrics = policy.step(rollouts, advantages, loss_fn=loss_fn)
        with clock("sync"):
            sync_metrics = resharder.sync(policy, engine)
        metrics = {**reward_metrics, **baseline_metrics, **train_metrics, **sync_metrics}
        return Step(metrics, rollouts)

    return run_steps(
        "ReMax",
        step,
        batches,
        steps=steps,
        on_step=on_step,
        progress=progress,
        blocks={"policy": policy, "resharder": resharder},
        config=config,
        checkpoint=checkpoint,
        resume=resume,
        after_resume=partial(resharder.resync, policy, engine),  # the engine has initial weights
        tracker=tracker,
    )


__all__ = ["greedy_baseline_rewards", "remax"]
