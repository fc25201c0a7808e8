"""PPO end to end on the tiny model: the reward of a toy task rises, the KL reaches the rewards
(or the loss), the KL controller moves β, the critic warms up alone."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from torch.testing import assert_close
from toy_tasks import count_prompts, digit_fraction

import rlblocks as rb
from rlblocks.critic import CriticTrainer
from rlblocks.data import PromptBatches
from rlblocks.losses import AdaptiveKLController, FixedKLController
from rlblocks.recipes.ppo import ppo

REWARD = rb.rewards.per_sample(digit_fraction, timeout=None)


def _blocks(lr: float, critic_lr: float):
    policy = tiny_trainer(lr=lr, reference="auto")  # reference: a copy
    critic = CriticTrainer(policy.model, lr=critic_lr)  # backbone copied from the policy, zero head
    engine = tiny_engine(policy)
    return policy, critic, engine


def run_ppo(blocks, steps: int, *, prompts: int = 8, run=None, **kw) -> list[dict]:
    """``ppo`` on 16 "Count: i" prompts; by default 4 samples of at most 8 tokens per prompt."""
    policy, critic, engine = blocks
    data = count_prompts()
    kw = {"group_size": 4, "sampling": rb.SamplingParams(max_new_tokens=8)} | kw
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ppo(
            policy,
            critic,
            engine,
            REWARD,
            PromptBatches(data, prompts_per_step=prompts, seed=0),
            steps=steps,
            run=dataclasses.replace(run or rb.run.RunOptions(), progress=False),
            **kw,
        )


def test_ppo_raises_the_reward_of_a_toy_task():
    history = run_ppo(_blocks(1e-2, 1e-3), 25, kl_coef=0.01)
    rewards = [h["reward/mean"] for h in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # Measured: the random tiny model writes ~2% digits (0.016, 0.018, 0.030 over the first
    # three steps); the reward passes 0.5 at the 14th step and after 25 PPO steps nearly every
    # character is a digit (0.967, 0.988, 0.988 over the last three).
    assert first < 0.1
    assert last > 0.8, rewards
    assert history[-1]["vf_optimizer_steps"] == 1.0 and "loss" in history[-1]


def test_ppo_with_zero_learning_rate_does_not_learn():
    # π_old scored by the trainer (not the engine's log-probs, which come from cached attention
    # and differ from the reference's forward by float rounding): KL is then exactly 0.
    history = run_ppo(
        _blocks(0.0, 1e-3), 25, kl_coef=0.01, run=rb.run.RunOptions(old_logprobs="recompute")
    )
    rewards = [h["reward/mean"] for h in history]
    # Same seeds, no policy update: the reward stays at the random model's level (measured
    # between 0.007 and 0.041 at every step; 0.031, 0.015, 0.021 over the last three), and the
    # policy never leaves the reference: KL exactly 0.
    assert sum(rewards[-3:]) / 3 < 0.1, rewards
    assert all(h["kl/seq"] == 0.0 for h in history)


def test_engine_sharing_the_model_gives_pi_old_by_default():
    # As in GRPO: an HFEngine around policy.model samples with the trainer's own weights, so
    # its log-probs are π_old (no scoring pass): the default run ("auto") equals "rollout" bit
    # for bit, and π_old against the rollout log-probs is exactly 0; scored by the trainer
    # ("recompute"), the cached-attention rounding shows in the mismatch metric.
    runs = {}
    for old in ("auto", "rollout", "recompute"):
        blocks = _blocks(1e-2, 1e-3)
        runs[old] = (
            run_ppo(blocks, 2, kl_coef=0.01, run=rb.run.RunOptions(old_logprobs=old)),
            blocks,
        )
    (auto, (policy, _, _)), (forced, (forced_policy, _, _)) = runs["auto"], runs["rollout"]
    assert [h["loss"] for h in auto] == [h["loss"] for h in forced]
    after, forced_after = _weights(policy.model), _weights(forced_policy.model)
    assert all(torch.equal(after[n], forced_after[n]) for n in after)
    assert all(h["mismatch/abs_max"] == 0.0 for h in auto)
    assert runs["recompute"][0][0]["mismatch/abs_max"] > 0.0


def _weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _changed(before, after) -> bool:
    return any(not torch.equal(before[n], after[n]) for n in before)


def test_critic_warmup_trains_only_the_critic():
    policy, critic, engine = _blocks(1e-2, 1e-2)
    policy0, critic0 = _weights(policy.model), _weights(critic.model)
    seen = []

    def snapshot(step, metrics, rollouts):
        seen.append((_weights(policy.model), _weights(critic.model), metrics))

    run_ppo(
        (policy, critic, engine),
        3,
        critic_warmup_steps=2,
        run=rb.run.RunOptions(on_step=snapshot),
    )
    (p0, c0, m0), (p1, c1, m1), (p2, _, m2) = seen
    assert not _changed(policy0, p0) and not _changed(policy0, p1)  # warm-up: policy frozen
    assert _changed(critic0, c0) and _changed(c0, c1)  # ... while the critic trains
    assert _changed(policy0, p2)  # after warm-up the policy trains too
    assert [m["critic_warmup"] for m in (m0, m1, m2)] == [1.0, 1.0, 0.0]
    assert "loss" not in m0 and "sync/version" not in m1
    assert m2["sync/version"] == 1.0 and m2["optimizer_steps"] == 1.0


class RecordingCritic:
    """A critic that also records, per step, the log-probs the recipe saw and the returns."""

    def __init__(self, critic: CriticTrainer, policy) -> None:
        self.critic, self.policy, self.seen = critic, policy, []

    def values(self, rollouts):
        # Called after the recipe scored π_old and π_ref and before any update: same weights.
        lp, ref = self.policy.logprobs(rollouts), self.policy.ref_logprobs(rollouts)
        self.seen.append({"rollouts": rollouts, "logprobs": lp, "ref_logprobs": ref})
        return self.critic.values(rollouts)

    def step(self, rollouts, returns, **kw):
        self.seen[-1]["returns"] = returns
        return self.critic.step(rollouts, returns, **kw)


@pytest.mark.parametrize("kl_in_reward", [True, False])
def test_kl_in_reward_or_in_loss(kl_in_reward):
    policy, critic, engine = _blocks(1e-2, 0.0)  # critic lr 0 and zero head: V = 0 throughout
    recorder = RecordingCritic(critic, policy)
    history = run_ppo(
        (policy, recorder, engine),
        3,
        prompts=4,
        group_size=2,
        kl_controller=FixedKLController(0.1),
        kl_in_reward=kl_in_reward,
        gamma=1.0,
        lam=1.0,
        run=rb.run.RunOptions(
            old_logprobs="recompute"
        ),  # π_old is the trainer's, as the recorder computes it
    )
    assert history[0]["kl/seq"] == 0.0 and history[-1]["kl/seq"] > 0  # the policy moved away
    for record in recorder.seen:
        ro = record["rollouts"]
        reward = torch.tensor([digit_fraction(c) for c in ro.completions])
        log_ratio = (record["logprobs"] - record["ref_logprobs"]) * ro.response_mask
        # γ = λ = 1 and V = 0: the return at the first token is the sum of all token rewards,
        # R_0 = r − β Σ_t k1_t = r − 0.1 · Σ_t (log π_old − log π_ref) with the KL in the
        # reward, and just r without.
        expected = reward - 0.1 * log_ratio.sum(-1) if kl_in_reward else reward
        assert_close(record["returns"][:, 0], expected)
    if kl_in_reward:
        assert "kl_loss" not in history[-1]
    else:
        # One mini-batch, one epoch: the update's first forward is π_old, so the KL term of the
        # loss (k3, the default in the loss) equals the KL the recipe measured with k3.
        for h in history:
            assert_close(h["kl_loss"], h["kl/token"])


@pytest.mark.parametrize(("target", "direction"), [(1e-3, "up"), (1e3, "down")])
def test_adaptive_controller_moves_beta(target, direction):
    # horizon = 32 = responses per step, so each update multiplies β by 1 + clip(e, ±0.2):
    # ×1.2 when KL > 1.2·target, ×0.8 when KL < 0.8·target.
    controller = AdaptiveKLController(0.01, target=target, horizon=32)
    history = run_ppo(_blocks(1e-2, 1e-3), 6, kl_controller=controller)
    betas = [h["kl/coef"] for h in history] + [controller.value]
    for k, h in enumerate(history):  # β_{k+1} = β_k (1 + clip(KL_k / target − 1, ±0.2) · 32/32)
        error = min(max(h["kl/seq"] / target - 1.0, -0.2), 0.2)
        assert_close(betas[k + 1], betas[k] * (1.0 + error))
    if direction == "down":  # KL ≪ 1000 nats: β shrinks at every step
        assert all(b1 < b0 for b0, b1 in itertools.pairwise(betas))
    else:  # step 0 has KL exactly 0 (policy = reference): β drops once, then grows
        assert betas[1] < betas[0] and betas[-1] > betas[0]
