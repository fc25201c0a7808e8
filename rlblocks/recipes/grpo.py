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
``on_step``, checkpoints) and where its rollouts come from are the run floor's,
`rlblocks.run`, shared by every recipe.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlblocks import interfaces
from rlblocks.advantage import grpo as grpo_advantage
from rlblocks.recipes.defaults import DEFAULT_SAMPLING, PPO_CLIP
from rlblocks.recipes.names import RECIPES
from rlblocks.rewards import checked
from rlblocks.run import Clock, RolloutSource, RunOptions, Step, recipe, run_config, run_steps


@RECIPES.register("grpo")
@recipe
def grpo(
    policy: interfaces.PolicyTrainer,
    engine: interfaces.RolloutEngine,
    reward_fn: interfaces.RewardFn,
    batches: Iterable[Any],
    *,
    steps: int,
    advantage: interfaces.AdvantageEstimator = grpo_advantage,
    loss_fn: interfaces.PolicyLoss = PPO_CLIP,
    group_size: int = 8,
    sampling: interfaces.SamplingParams = DEFAULT_SAMPLING,
    run: RunOptions | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` GRPO steps; returns one metrics dict per step.

    ``batches`` yields prompt batches with ``.prompts`` and ``.metadata`` (see
    :mod:`rlblocks.data`). ``run`` (a `rlblocks.run.RunOptions`) says how the run is driven:
    ``on_step(step, metrics, rollouts)`` after every step (raise ``StopIteration`` to end
    early), progress bar, checkpoint and resume (bit for bit, docs/checkpoints.md), tracker,
    and where rollouts and π_old come from (``staleness=1`` samples the next batch while the
    trainer updates on this one; ``old_logprobs``: docs/run.md).

    Metrics: the reward function's (``reward/mean``), the trainer's, the resharder's, and the
    ones every recipe reports (`rlblocks.run.loop`): ``time/rollout``, ``time/reward``,
    ``time/logprobs``, ``time/update``, ``time/sync``, ``step_seconds``, ``response_length``,
    ``kl/token`` when the loss has a KL term, and ``async/*`` with a background sampler.
    """
    config = run_config("grpo", locals())  # logged once, checked on resume
    reward_fn = checked(reward_fn)  # the RewardFn contract; a NaN/inf row gets 0.0, counted
    source = RolloutSource(engine, policy, batches, run, group_size=group_size, sampling=sampling)
    loss_fn = source.corrected(loss_fn)  # run.correction: for stale rows (k steps off)

    def step(index: int, clock: Clock) -> Step | None:
        rollouts = source.draw(clock)  # 1. G samples per prompt, π_old as run= says
        with clock("reward"):  # 2. one scalar per response
            rewards, metrics = reward_fn(rollouts)
        rollouts = rollouts.replace(rewards=rewards)  # kept with the rows (dashboards read it)
        advantages, _ = advantage(rewards, rollouts.response_mask, rollouts.group_ids)  # 3.
        with clock("update"):  # 4. (π_old, when not drawn, comes from the trainer)
            metrics |= policy.step(rollouts, advantages, loss_fn=loss_fn)
        metrics |= source.sync(clock)  # 5. the new weights into the engine
        return Step(metrics, rollouts)

    return run_steps(
        "GRPO", step, source, steps=steps, run=run, config=config, blocks={"policy": policy}
    )
