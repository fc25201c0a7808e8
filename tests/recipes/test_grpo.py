"""GRPO end to end on the tiny model: the reward of a verifiable toy task must really rise."""

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import digit_fraction, run_group_recipe

import rlblocks as rb
from rlblocks.data import PromptBatches, load_prompts


def run_grpo(lr: float, steps: int = 30) -> list[float]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = tiny_trainer(lr=lr)
        engine = tiny_engine(policy)
        history = run_group_recipe(rb.recipes.grpo, policy, engine, steps=steps)
    return [h["reward/mean"] for h in history]


def test_grpo_raises_the_reward_of_a_toy_task():
    rewards = run_grpo(lr=1e-2)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # Measured: a random tiny model writes ~2% digits (0.02, 0.013, 0.034 over the first three
    # steps); after 30 GRPO steps nearly every character is a digit (last three steps ~1.0).
    assert first < 0.1
    assert last > 0.8, rewards


def test_grpo_with_zero_learning_rate_does_not_learn():
    rewards = run_grpo(lr=0.0)
    last = sum(rewards[-3:]) / 3
    # Same seeds, no update: the reward stays at the random model's level.
    assert last < 0.1, rewards


def test_on_step_can_stop_early():
    seen = []

    def stop_after_two(step, metrics, rollouts):
        seen.append((step, rollouts.batch_size, metrics["reward/mean"]))
        if step == 1:
            raise StopIteration

    policy = tiny_trainer(lr=1e-3)
    engine = tiny_engine(policy)
    data = load_prompts([{"prompt": "Count:", "ground_truth": "0"}] * 4)
    history = rb.recipes.grpo(
        policy,
        engine,
        rb.rewards.per_sample(digit_fraction, timeout=None),
        PromptBatches(data, prompts_per_step=2, seed=0),
        steps=10,
        group_size=3,
        sampling=rb.SamplingParams(max_new_tokens=4),
        run=rb.run.RunOptions(on_step=stop_after_two, progress=False),
    )
    assert [s[:2] for s in seen] == [(0, 6), (1, 6)]
    assert len(history) == 2
    for key in ("reward/mean", "loss", "grad_norm", "sync/version", "response_length"):
        assert key in history[0], key


@pytest.mark.parametrize("score", [0.0, 1.0])
def test_evaluate_scores_greedy_answers(score):
    model, tokenizer = rb.models.tiny(seed=0)
    engine = rb.rollout.HFEngine(model, tokenizer, progress=False)
    reward = rb.rewards.per_sample(lambda completion, **row: score, timeout=None)
    result = rb.recipes.evaluate(
        engine, ["a", "b", "c"], reward, sampling=rb.SamplingParams(max_new_tokens=3, temperature=0)
    )
    assert result.score == score
    assert len(result.samples(2)) == 2
    with pytest.raises(ValueError, match="at least one prompt"):
        rb.recipes.evaluate(engine, [], reward)


def _weights_after_grpo(engine_kind: str, reuse, steps: int = 2):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = tiny_trainer()
        # "copy": its own copy of the same weights, synced by the resharder
        engine = tiny_engine(policy, shared=engine_kind == "shared")
        old = {None: "auto", True: "rollout", False: "recompute"}[reuse]
        history = run_group_recipe(
            rb.recipes.grpo, policy, engine, steps=steps, run=rb.run.RunOptions(old_logprobs=old)
        )
    return history, {n: p.detach().clone() for n, p in policy.model.named_parameters()}


def test_engine_sharing_the_model_gives_pi_old_by_default():
    # Default (None): an HFEngine around policy.model samples with the trainer's own weights at
    # its temperature, so its log-probs are taken as π_old: the run equals reuse=True bit for
    # bit, and π_old against the rollout log-probs is exactly 0 (they are the same tensor).
    auto, auto_weights = _weights_after_grpo("shared", None)
    forced, forced_weights = _weights_after_grpo("shared", True)
    assert [h["loss"] for h in auto] == [h["loss"] for h in forced]
    for name, value in auto_weights.items():
        assert torch.equal(value, forced_weights[name]), name
    assert all(h["mismatch/abs_max"] == 0.0 for h in auto)


def test_a_separate_engine_copy_is_never_taken_for_pi_old():
    # Its own copy could be stale: the trainer scores π_old itself, and the mismatch metric
    # shows a nonzero gap (cached against uncached attention rounding, at least).
    history, _ = _weights_after_grpo("copy", None, steps=1)
    assert history[0]["mismatch/abs_max"] > 0.0


def test_samples_with_policy_needs_the_same_module_and_temperature():
    from rlblocks.run import samples_with_policy

    policy = tiny_trainer()
    shared, copy = tiny_engine(policy), tiny_engine(policy, shared=False)
    t1, t07 = rb.SamplingParams(temperature=1.0), rb.SamplingParams(temperature=0.7)
    assert samples_with_policy(policy, shared, t1)
    assert samples_with_policy(policy, shared, rb.SamplingParams(temperature=0.0))  # T=1 lps
    assert not samples_with_policy(policy, shared, t07)  # the trainer scores at T = 1
    assert not samples_with_policy(policy, copy, t1)
    hot = tiny_trainer(temperature=0.7)
    assert samples_with_policy(hot, tiny_engine(hot), t07)
