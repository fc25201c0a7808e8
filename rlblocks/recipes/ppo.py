"""PPO with a learned critic, written only with public blocks: read it, copy it, change it.

One step (Schulman et al. 2017, arXiv 1707.06347, Algorithm 1, as applied to language models by
Ziegler et al. 2019, arXiv 1909.08593, sec. 2.2, and InstructGPT, Ouyang et al. 2022, arXiv
2203.02155, sec. 3.5):

1. sample responses with the current policy (``group_size`` per prompt);
2. score them with the reward function (one scalar per response);
3. before any update: log π_old and log π_ref of every response token, and the critic's V;
4. the KL to the reference, either as a per-token reward penalty r_t = −β·k_t (default,
   Ziegler et al.) or as a loss term β·k_t (``kl_in_reward=False``, as GRPO does); β comes from
   a KL controller, updated with the measured KL after it is used;
5. GAE advantages and λ-returns from the per-token rewards and V; advantages whitened over
   the batch;
6. a critic update towards the returns (clipped value loss);
7. a policy update with the clipped surrogate, skipped during the first
   ``critic_warmup_steps`` steps (only the critic trains while it learns the values of the
   initial policy);
8. push the new policy weights into the rollout engine.

Simplifications: every step draws fresh prompts; the critic and the policy are updated from the
same batch one after the other (not interleaved per mini-batch); the reward is an outcome
reward put on each response's last token. The loop around the step (progress, ``time/*``,
``on_step``, checkpoints) and where its rollouts come from are the run floor's,
`rlblocks.run`, shared by every recipe.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlblocks import interfaces
from rlblocks.advantage import gae, whiten
from rlblocks.base.masked import masked_mean
from rlblocks.losses import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    k1,
    k3,
    kl_penalty_rewards,
    kl_regularized,
)
from rlblocks.recipes.defaults import DEFAULT_SAMPLING, PPO_CLIP
from rlblocks.recipes.names import RECIPES
from rlblocks.rewards import checked
from rlblocks.run import RolloutSource, Run, RunOptions, run_config


@RECIPES.register("ppo")
def ppo(
    policy: interfaces.PolicyTrainer,
    critic: interfaces.Critic,
    engine: interfaces.RolloutEngine,
    reward_fn: interfaces.RewardFn,
    batches: Iterable[Any],
    *,
    steps: int,
    gamma: float = 1.0,
    lam: float = 0.95,
    kl_coef: float = 0.05,
    kl_controller: FixedKLController | AdaptiveKLController | None = None,
    kl_in_reward: bool = True,
    kl_estimator: KLEstimator | None = None,
    loss_fn: interfaces.PolicyLoss = PPO_CLIP,
    critic_warmup_steps: int = 0,
    value_clip: float | None = 0.2,
    group_size: int = 1,
    sampling: interfaces.SamplingParams = DEFAULT_SAMPLING,
    run: RunOptions | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` PPO steps (module docstring); returns one metrics dict per step.

    ``policy`` needs a reference model (``PolicyTrainer``'s default ``reference="auto"``).
    ``critic``: any `rlblocks.interfaces.Critic` (``rb.critic.CriticTrainer``).
    ``kl_controller``: a ``FixedKLController`` or ``AdaptiveKLController`` (anything with
    ``.value`` and ``.update(kl, n_steps)``); None means ``FixedKLController(kl_coef)``. It is
    updated once per step with the mean per-sequence KL Σ_t k_t (the ``kl_per_seq`` metric of
    ``kl_penalty_rewards``, Ziegler et al.'s unit) over ``n_steps`` = the number of responses.
    ``kl_estimator``: the per-token estimate k_t of KL(π_θ ‖ π_ref); None means ``k1`` in the
    reward (its sum over a response is exactly the sequence log-ratio) and ``k3`` in the loss
    (GRPO's; ``k1``'s gradient as a loss is zero in expectation). ``value_clip``: ε of the
    clipped value loss, in units of the returns (None: no clipping). GAE: ``gamma`` (γ),
    ``lam`` (λ).

    Metrics: the reward function's (``reward/mean``), ``kl/token``, ``kl/seq`` and ``kl/coef``
    (the β used this step), ``returns_mean``, the critic's ``vf_*`` and ``values_mean``, the
    policy's (absent during warm-up; ``kl_loss`` with ``kl_in_reward=False``), the
    resharder's, ``critic_warmup`` (1 during warm-up), and the ones every recipe reports
    (`rlblocks.run.clock`): ``time/*`` (π_old, π_ref and V are ``time/logprobs``, the critic
    and policy updates ``time/update``), ``step_seconds``, ``response_length``. ``batches``
    and ``run`` (a `rlblocks.run.RunOptions`: on_step, checkpoint, resume, tracker, staleness,
    π_old) work as in :func:`~rlblocks.recipes.grpo`.
    """
    config = run_config("ppo", locals())  # logged once, checked on resume
    reward_fn = checked(reward_fn)  # the RewardFn contract; a NaN/inf row gets 0.0, counted
    controller = kl_controller or FixedKLController(kl_coef)
    estimator = kl_estimator or (k1 if kl_in_reward else k3)
    blocks = {"policy": policy, "critic": critic, "kl_controller": controller}
    run = Run("ppo", steps=steps, blocks=blocks, config=config, options=run)
    source = RolloutSource(engine, policy, batches, run, group_size=group_size, sampling=sampling)
    loss_fn = source.corrected(loss_fn)  # RunOptions.correction: for stale rows (k steps off)
    with run.driving(source):
        for step in run:
            rollouts = source.draw()  # 1.
            with run.phase("reward"):  # 2. one scalar per response
                rewards, reward_metrics = reward_fn(rollouts)
            mask = rollouts.response_mask
            rollouts = source.with_old_logprobs(rollouts)  # 3. all before any update
            with run.phase("logprobs"):
                ref_logprobs = policy.ref_logprobs(rollouts)
                values = critic.values(rollouts)
            rollouts = rollouts.replace(rewards=rewards, ref_logprobs=ref_logprobs)
            beta = controller.value  # 4. KL penalty with the current β, then adapt β
            assert rollouts.old_logprobs is not None  # with_old_logprobs set it
            penalized, kl = kl_penalty_rewards(
                rewards,
                rollouts.old_logprobs,
                ref_logprobs,
                mask,
                kl_coef=beta,
                estimator=estimator,
            )
            controller.update(kl["kl_per_seq"], n_steps=len(rollouts))
            token_rewards = penalized if kl_in_reward else rewards
            advantages, returns = gae(  # 5.
                token_rewards, mask, rollouts.group_ids, values=values, gamma=gamma, lam=lam
            )
            advantages = whiten(advantages, mask)
            metrics = {
                **reward_metrics,
                "kl/token": float(kl["kl"]),
                "kl/seq": float(kl["kl_per_seq"]),
                "kl/coef": beta,
                "returns_mean": float(masked_mean(returns, mask)),
            }
            with run.phase("update"):  # 6.
                metrics |= critic.step(rollouts, returns, old_values=values, clip=value_clip)
            warmup = step < critic_warmup_steps
            if not warmup:  # 7. and 8.
                policy_loss = (
                    loss_fn
                    if kl_in_reward
                    else kl_regularized(loss_fn, kl_coef=beta, estimator=estimator)
                )
                with run.phase("update"):
                    metrics |= policy.step(rollouts, advantages, loss_fn=policy_loss)
                metrics |= source.sync()
            run.record({**metrics, "critic_warmup": float(warmup)}, rollouts)
    return run.history
