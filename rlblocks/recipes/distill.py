"""On-policy distillation, written only with public blocks: read it, copy it, change it.

One step (GKD, Agarwal et al. 2024, arXiv 2306.13649, with λ = 1: all data on-policy; Lu &
Thinking Machines 2025, "On-Policy Distillation"; the on-policy stage of Qwen3, arXiv
2505.09388, sec. 4.5):

1. the student samples G responses for each of P prompts;
2. the student's log-probs of them (π_old: the engine's, when it samples with the trainer's
   own module) and the teacher's (`rlblocks.trainer.Teacher.logprobs`);
3. per-token advantage −β·(log π_θ − log π_T) (`rlblocks.advantage.teacher_kl`), plus the
   task reward's group-normalized advantage when a ``reward_fn`` is given;
4. the usual policy update with the PPO clip; 5. push the new weights into the engine.

The teacher must share the student's tokenizer (it scores the student's token ids). The loop
around the step (progress, ``time/*``, ``on_step``, checkpoints) and where its rollouts come
from are the run floor's, `rlblocks.run`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlblocks import interfaces
from rlblocks.advantage import grpo as grpo_advantage
from rlblocks.advantage import teacher_kl
from rlblocks.losses import reverse_kl
from rlblocks.recipes.defaults import DEFAULT_SAMPLING, PPO_CLIP
from rlblocks.recipes.names import RECIPES
from rlblocks.rewards import checked
from rlblocks.run import RolloutSource, Run, RunOptions, run_config


@RECIPES.register("distill")
def distill(
    policy: interfaces.PolicyTrainer,
    engine: interfaces.RolloutEngine,
    teacher: interfaces.Teacher,
    batches: Iterable[Any],
    *,
    steps: int,
    reward_fn: interfaces.RewardFn | None = None,
    advantage: interfaces.AdvantageEstimator = grpo_advantage,
    kl_coef: float = 1.0,
    loss_fn: interfaces.PolicyLoss = PPO_CLIP,
    group_size: int = 4,
    sampling: interfaces.SamplingParams = DEFAULT_SAMPLING,
    run: RunOptions | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` steps of on-policy distillation from ``teacher`` into ``policy``.

    ``kl_coef``: β of the reverse-KL advantage (`rlblocks.advantage.teacher_kl`). ``reward_fn`` (optional): a task reward whose
    ``advantage(rewards, mask, group_ids)`` is added to it, distillation and RL in one update
    (``group_size`` > 1 then, for GRPO's groups). ``batches``: prompt batches (``.prompts``,
    ``.metadata``). ``run``: as in `rlblocks.recipes.grpo` (π_old is the engine's when it
    samples with the trainer's module, else the trainer scores it before the update).

    Metrics: ``distill/reverse_kl`` (mean per-token k1 estimate of KL(π_θ ‖ π_T) at π_old),
    ``distill/teacher_logprob``, the reward's (``reward/mean``) when given, the trainer's, the
    resharder's and the loop's (the teacher's scoring is ``time/logprobs``).
    """
    config = run_config("distill", locals())
    run = Run("distill", steps=steps, blocks={"policy": policy}, config=config, options=run)
    reward_fn = checked(reward_fn) if reward_fn is not None else None
    source = RolloutSource(engine, policy, batches, run, group_size=group_size, sampling=sampling)
    loss_fn = source.corrected(loss_fn)  # RunOptions.correction: for stale rows (k steps off)
    with run.driving(source):
        for step in run:
            rollouts = source.draw()  # 1.
            rollouts = source.with_old_logprobs(rollouts)  # 2. π_old, then the teacher's
            with run.phase("logprobs"):
                teacher_lp = teacher.logprobs(rollouts)
            old, mask = rollouts.old_logprobs, rollouts.response_mask
            assert old is not None  # with_old_logprobs set it
            _, kl_metrics = reverse_kl(old, teacher_lp, mask)  # 3.
            metrics: dict[str, Any] = {**kl_metrics}  # tensors, then the reward's, update's
            advantages = teacher_kl(old, teacher_lp, mask, kl_coef=kl_coef).advantages
            if reward_fn is not None:
                with run.phase("reward"):
                    rewards, reward_metrics = reward_fn(rollouts)
                rollouts = rollouts.replace(rewards=rewards)
                advantages = advantages + advantage(rewards, mask, rollouts.group_ids).advantages
                metrics |= reward_metrics
            with run.phase("update"):  # 4.
                metrics |= policy.step(rollouts, advantages, loss_fn=loss_fn)
            metrics |= source.sync()  # 5.
            run.record({k: float(v) for k, v in metrics.items()}, rollouts)
    return run.history


__all__ = ["distill"]
