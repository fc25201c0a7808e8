"""GRPO-family variants. Most are one keyword of `rlblocks.recipes.grpo`; ReMax needs one more
generation per step, so it gets this short recipe.

The one-keyword variants (see docs/algorithms/variants.md)::

    grpo(..., advantage=rb.advantage.rloo)                          # RLOO
    grpo(..., advantage=rb.advantage.reinforce_pp_baseline)         # REINFORCE++-baseline
    grpo(..., advantage=partial(rb.advantage.grpo, scale_by_std=False))   # Dr.GRPO, with a
    # trainer built with aggregation=rb.losses.SeqMeanTokenSumNorm(max_tokens=max_new_tokens)

ReMax (Li et al. 2023, arXiv 2310.10505) subtracts the reward of the *greedy* response to the
same prompt. The GRPO recipe calls ``advantage(rewards, mask, group_ids)``, which cannot
generate, so `remax` is the GRPO loop with two lines more: `with_greedy_answers` (each prompt
answered greedily beside its samples, by the same weights) and `greedy_baseline_rewards`
(score them, give each row its prompt's score) feeding ``rb.advantage.remax``'s
``baseline_rewards=``. The loop around the step (progress, ``time/*``, ``on_step``,
checkpoints) and where its rollouts come from are the run floor's, `rlblocks.run`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from rlblocks import interfaces
from rlblocks.advantage import remax as remax_advantage
from rlblocks.recipes.defaults import DEFAULT_SAMPLING, PPO_CLIP
from rlblocks.recipes.names import RECIPES
from rlblocks.rewards import checked
from rlblocks.run import RolloutSource, Run, RunOptions, run_config

#: The extra that marks ReMax's greedy rows among the sampled ones (`with_greedy_answers`).
GREEDY = "greedy"


def with_greedy_answers(
    engine: interfaces.RolloutEngine,
    batch: Any,
    *,
    group_size: int,
    sampling: interfaces.SamplingParams,
) -> interfaces.Rollouts:
    """``group_size`` samples of each prompt of ``batch`` (``.prompts``, ``.metadata``), then
    one greedy answer ȳ(x) of each (temperature 0, ``sampling``'s other settings kept), by the
    same weights: ReMax's rows (Li et al. 2023, arXiv 2310.10505, Algorithm 1, lines 4-5).
    The greedy rows come last, marked True in ``extras["greedy"]`` (b) bool."""
    sampled = engine.generate(
        batch.prompts, group_size=group_size, sampling=sampling, metadata=batch.metadata
    )
    greedy_sampling = dataclasses.replace(sampling, temperature=0.0)
    greedy = engine.generate(
        batch.prompts, group_size=1, sampling=greedy_sampling, metadata=batch.metadata
    )
    return interfaces.Rollouts.concat(
        [
            sampled.with_extras(**{GREEDY: torch.zeros(len(sampled), dtype=torch.bool)}),
            greedy.with_extras(**{GREEDY: torch.ones(len(greedy), dtype=torch.bool)}),
        ]
    )


def greedy_baseline_rewards(
    reward_fn: interfaces.RewardFn, rollouts: interfaces.Rollouts, greedy: interfaces.Rollouts
) -> interfaces.RewardOutput:
    """ReMax's baseline (Li et al. 2023, arXiv 2310.10505, Algorithm 1, line 5): the reward of
    the greedy response ȳ to each row's prompt x.

        bᵢ = r(x(i), ȳ(x(i))),   ȳ(x) = argmax decoding of x (temperature 0)

    ``greedy`` holds one greedy answer per prompt of ``rollouts`` (`with_greedy_answers`),
    scored here with ``reward_fn``. Rows are matched to their prompt by the rendered prompt
    text (``rollouts.prompts``), so an engine may order rows as it likes; equal prompts share a
    greedy answer anyway. Returns `RewardOutput(rewards (b) float32, metrics)`, no gradient;
    ``reward_fn``'s metrics are renamed ``"baseline/…"``.
    """
    greedy_rewards, metrics = reward_fn(greedy)  # (p) one per prompt
    prompt_of = {text: i for i, text in enumerate(greedy.prompts)}
    missing = sorted(set(rollouts.prompts) - set(prompt_of))
    if missing:
        raise ValueError(
            f"greedy_baseline_rewards: no greedy answer for the prompt {missing[0]!r}; answer "
            f"every prompt of the rollouts greedily (with_greedy_answers)"
        )
    rows = torch.tensor([prompt_of[text] for text in rollouts.prompts], dtype=torch.long)
    renamed = {f"baseline/{k.removeprefix('reward/')}": float(v) for k, v in metrics.items()}
    return interfaces.RewardOutput(greedy_rewards.detach().float().cpu()[rows], renamed)


@RECIPES.register("remax")
def remax(
    policy: interfaces.PolicyTrainer,
    engine: interfaces.RolloutEngine,
    reward_fn: interfaces.RewardFn,
    batches: Iterable[Any],
    *,
    steps: int,
    loss_fn: interfaces.PolicyLoss = PPO_CLIP,
    group_size: int = 1,
    sampling: interfaces.SamplingParams = DEFAULT_SAMPLING,
    run: RunOptions | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` ReMax steps; returns one metrics dict per step.

    ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models", arXiv 2310.10505, Algorithm 1):

        Aᵢ = r(x, yᵢ) − r(x, ȳ),   yᵢ ~ π_θ(·|x),  ȳ = greedy decoding of x

    The GRPO recipe's loop with the greedy answers sampled beside the others by the same
    weights (`with_greedy_answers`, also one step off) and their rewards
    (`greedy_baseline_rewards`) passed to ``rb.advantage.remax(baseline_rewards=...)``.
    ``group_size`` samples per prompt (the paper uses 1; the baseline needs no group). One
    greedy generation per prompt per step more than GRPO, in exchange for no group statistics.
    Metrics: the reward's (``reward/mean``), ``baseline/…`` (the greedy answers'), the
    trainer's, the resharder's, and the ones every recipe reports (`rlblocks.run.clock`):
    ``time/*`` (the greedy generation is ``time/rollout``, its scoring ``time/reward``),
    ``step_seconds``, ``response_length`` and ``kl/token`` when the loss has a KL term.
    ``run``: as in `rlblocks.recipes.grpo`.
    """
    config = run_config("remax", locals())  # logged once, checked on resume
    run = Run("remax", steps=steps, blocks={"policy": policy}, config=config, options=run)
    reward_fn = checked(reward_fn)  # the RewardFn contract; a NaN/inf row gets 0.0, counted

    def sample(batch: Any) -> interfaces.Rollouts:
        return with_greedy_answers(engine, batch, group_size=group_size, sampling=sampling)

    source = RolloutSource(
        engine,
        policy,
        batches,
        run,
        group_size=group_size,
        sampling=sampling,
        sample=sample,
    )
    loss_fn = source.corrected(loss_fn)  # RunOptions.correction: for stale rows (k steps off)
    with run.driving(source):
        for step in run:
            drawn = source.draw()  # the samples, then the greedy answers
            greedy_rows = drawn.extras[GREEDY]
            rollouts, greedy = drawn.select(~greedy_rows), drawn.select(greedy_rows)
            with run.phase("reward"):
                rewards, metrics = reward_fn(rollouts)
                baseline, baseline_metrics = greedy_baseline_rewards(reward_fn, rollouts, greedy)
            rollouts = rollouts.replace(rewards=rewards)  # kept with the rows (dashboards)
            advantages, _ = remax_advantage(
                rewards, rollouts.response_mask, rollouts.group_ids, baseline_rewards=baseline
            )
            with run.phase("update"):
                metrics |= policy.step(rollouts, advantages, loss_fn=loss_fn)
            metrics |= source.sync()
            run.record({**metrics, **baseline_metrics}, rollouts)
    return run.history


__all__ = ["GREEDY", "greedy_baseline_rewards", "remax", "with_greedy_answers"]
