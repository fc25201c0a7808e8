"""GRPO, written only with public blocks: read it, copy it, change it.

One step (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, sec. 4):

1. sample G responses for each of P prompts with the current policy;
2. score them with the reward function;
3. advantage = reward standardized within its group (no critic);
4. update the policy with the clipped surrogate, several mini-batches if asked;
5. push the new weights into the rollout engine.

Simplifications: the reference-policy KL term is left out by default (DAPO and Dr.GRPO drop it
too; pass a loss that takes ``ref_logprobs``, e.g. `rlblocks.losses.kl_regularized`, to add it
back), and every step draws fresh prompts. The body is the README's cell ("GRPO in one cell"),
line for line (tests/test_readme.py compares them): `rlblocks.run.Run` gives the loop resume,
checkpoints, the tracker, progress and ``time/*``; `rlblocks.run.RolloutSource` decides where
the rollouts and their π_old come from (in the step, or k steps off).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlblocks import interfaces
from rlblocks.advantage import grpo as grpo_advantage
from rlblocks.recipes.defaults import DEFAULT_SAMPLING, PPO_CLIP
from rlblocks.recipes.names import RECIPES
from rlblocks.rewards import checked
from rlblocks.run import RolloutSource, Run, RunOptions, run_config


@RECIPES.register("grpo")
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
    ones every recipe reports (`rlblocks.run.clock`): ``time/rollout``, ``time/reward``,
    ``time/logprobs``, ``time/update``, ``time/sync``, ``step_seconds``, ``response_length``,
    ``kl/token`` when the loss has a KL term, and ``async/*`` with a background sampler.
    """
    config = run_config("grpo", locals())  # logged once, checked on resume
    run = Run("grpo", steps=steps, blocks={"policy": policy}, config=config, options=run)
    reward_fn = checked(reward_fn)  # the RewardFn contract; a NaN/inf row gets 0.0, counted
    source = RolloutSource(engine, policy, batches, run, group_size=group_size, sampling=sampling)
    loss_fn = source.corrected(loss_fn)  # IcePop's mask when k steps off (RunOptions.correction)
    with run.driving(source):  # lock; resume, or save step 0
        for step in run:  # progress bar, watchdog, the step's clock
            rollouts = source.draw()  # 1. G samples per prompt, π_old as the source says
            with run.phase("reward"):  # 2. one scalar per response
                rewards, metrics = reward_fn(rollouts)
            advantages, _ = advantage(rewards, rollouts.response_mask, rollouts.group_ids)  # 3.
            with run.phase("update"):  # 4. (π_old, when not drawn, comes from the trainer)
                metrics |= policy.step(rollouts, advantages, loss_fn=loss_fn)
            metrics |= source.sync()  # 5. the engine gets the new weights
            run.record(metrics, rollouts.replace(rewards=rewards))  # tracker, checkpoint
    return run.history
