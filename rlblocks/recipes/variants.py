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
``baseline_rewards=``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import torch
from tqdm.auto import tqdm

from rlblocks import resharder as resharders
from rlblocks.advantage import remax as remax_advantage
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
from rlblocks.recipes.grpo import DEFAULT_SAMPLING, PPO_CLIP, StepCallback


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
) -> list[dict[str, Any]]:
    """Run ``steps`` ReMax steps; returns one metrics dict per step.

    ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models", arXiv 2310.10505, Algorithm 1):

        Aᵢ = r(x, yᵢ) − r(x, ȳ),   yᵢ ~ π_θ(·|x),  ȳ = greedy decoding of x

    The GRPO recipe's loop with the greedy baseline (`greedy_baseline_rewards`) passed to
    ``rb.advantage.remax(baseline_rewards=...)``. ``group_size`` samples per prompt (the paper
    uses 1; the baseline needs no group). One greedy generation per prompt per step more than
    GRPO, in exchange for no group statistics. Metrics: the reward's, ``baseline/…`` (the greedy
    answers'), the trainer's, the resharder's, ``response_length`` and ``step_seconds``.
    ``on_step``: as in `rlblocks.recipes.grpo`.
    """
    resharder = resharder or resharders.Resharder()
    history: list[dict[str, Any]] = []
    bar = tqdm(total=steps, desc="ReMax", disable=not progress, unit="step")
    for step, batch in zip(range(steps), batches, strict=False):
        start = time.perf_counter()
        rollouts = engine.generate(
            batch.prompts, n=group_size, sampling=sampling, metadata=batch.metadata
        )
        rewards, reward_metrics = reward_fn(rollouts)
        baseline, baseline_metrics = greedy_baseline_rewards(  # the one extra line of ReMax
            engine, reward_fn, rollouts, batch, sampling=sampling
        )
        advantages, _ = remax_advantage(
            rewards, rollouts.response_mask, rollouts.group_ids, baseline_rewards=baseline
        )
        train_metrics = policy.step(rollouts, advantages, loss_fn=loss_fn)
        metrics = {
            **reward_metrics,
            **baseline_metrics,
            **train_metrics,
            **resharder.sync(policy, engine),
            "response_length": rollouts.response_lengths.float().mean().item(),
            "step_seconds": time.perf_counter() - start,
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


__all__ = ["greedy_baseline_rewards", "remax"]
