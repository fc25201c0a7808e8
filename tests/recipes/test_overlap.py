"""One-step-off rollouts (rlblocks.recipes.overlap) in GRPO on the tiny model: staleness 0 is the
synchronous loop bit for bit, staleness 1 trains each batch on weights one update newer than
those that sampled it, learns, resumes exactly, and refuses an engine sharing the model."""

from __future__ import annotations

import copy

import pytest
import torch
from resume_helpers import assert_identical, untimed
from toy_tasks import run_group_recipe

import rlblocks as rb
from rlblocks.recipes.overlap import OneStepOff
from rlblocks.trainer.forward import score_responses


def _blocks(engine_kind: str, lr: float = 1e-2):
    torch.manual_seed(0)
    model, tokenizer = rb.models.tiny(seed=0)
    policy = rb.trainer.PolicyTrainer(model, tokenizer=tokenizer, lr=lr, reference=None)
    if engine_kind == "shared":
        engine = rb.rollout.HFEngine(policy.model, tokenizer, progress=False)
    else:  # its own copy of the weights, synced by the resharder after every update
        engine = rb.rollout.HFEngine(copy.deepcopy(model), tokenizer, progress=False)
    return policy, engine


def _run(engine_kind: str, steps: int, *, lr: float = 1e-2, on_step=None, **kw) -> dict:
    policy, engine = _blocks(engine_kind, lr)
    history = run_group_recipe(rb.recipes.grpo, policy, engine, steps=steps, on_step=on_step, **kw)
    return {"history": history, "policy": policy.model.state_dict()}


def _weights(policy_or_model):
    return {n: p.detach().clone() for n, p in policy_or_model.state_dict().items()}


@pytest.mark.parametrize("engine_kind", ["shared", "copy"])
@pytest.mark.parametrize("old_logprobs", ["recompute", "rollout"])
def test_staleness_zero_is_the_synchronous_loop_bit_for_bit(engine_kind, old_logprobs):
    # The same batches, sampled in the background thread but only after each sync: every
    # metric (timings aside) and every weight equal the synchronous recipe's. "rollout"
    # matches the synchronous loop that reuses the engine's log-probs.
    reuse = old_logprobs == "rollout" or None
    sync = _run(engine_kind, 3, reuse_rollout_logprobs=reuse)
    overlap = OneStepOff(staleness=0, old_logprobs=old_logprobs)
    async_ = _run(engine_kind, 3, reuse_rollout_logprobs=reuse, async_rollout=overlap)
    for h in async_["history"]:
        assert h.pop("async/staleness") == 0.0
        assert h.pop("async/sample_seconds") > 0
    assert_identical(async_, sync, steps=3)


def test_staleness_one_trains_on_batches_sampled_by_the_previous_weights():
    # Record the weights before each update; the rollouts of step k (k >= 1) must carry the
    # log-probs of the weights before update k - 1 (the engine's, synced after step k - 2)
    # rather than those before update k, which the trainer holds when it trains on them.
    snapshots, batches = [], []
    policy, engine = _blocks("copy")
    snapshots.append(_weights(policy.model))

    def keep(step, metrics, rollouts):
        snapshots.append(_weights(policy.model))  # after update `step`
        batches.append(rollouts)

    history = run_group_recipe(
        rb.recipes.grpo, policy, engine, steps=3, on_step=keep, async_rollout=OneStepOff()
    )
    assert [h["async/staleness"] for h in history] == [0.0, 1.0, 1.0]
    model = copy.deepcopy(policy.model)
    for k in (1, 2):
        ro = batches[k]
        real = ro.response_attention_mask
        gaps = []
        for before in (k - 1, k):  # sampled by θ before update k-1, trained from θ before k
            model.load_state_dict(snapshots[before])
            with torch.no_grad():
                lp, _ = score_responses(model, ro, chunk_size=64)
            gaps.append((lp[real] - ro.rollout_logprobs[real]).abs().max().item())
        # Cached against uncached attention rounds the log-probs by ~1e-6 in float32
        # (measured: 4.8e-7); one update at lr 1e-2 moves them by ~1 (measured: 0.79, 1.0).
        assert gaps[0] < 1e-5 and gaps[1] > 0.1, (k, gaps)


def test_staleness_one_learns_the_toy_task():
    # The task of tests/recipes/test_grpo.py (a random tiny model writes ~2% digits); one
    # update stale, π_old recomputed, the reward still climbs far past where lr 0 stays (< 0.1).
    history = _run("copy", 30, async_rollout=OneStepOff())["history"]
    rewards = [h["reward/mean"] for h in history]
    assert sum(rewards[-3:]) / 3 > 0.8, rewards


def test_an_engine_sharing_the_model_is_refused_one_step_off():
    with pytest.raises(ValueError, match="needs an engine with its own copy of the weights"):
        _run("shared", 1, async_rollout=OneStepOff(staleness=1))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="staleness must be 0 or 1"):
        OneStepOff(staleness=2)
    with pytest.raises(ValueError, match="old_logprobs must be"):
        OneStepOff(old_logprobs="engine")


def test_a_stopped_async_run_resumes_on_the_batch_it_had_sampled_ahead(tmp_path):
    # The checkpoint after step 2 holds batch 3, sampled during step 2 by the weights before
    # update 2; the resumed run trains on it and ends as the run that went straight through.
    def stop_after_two(step, metrics, rollouts):
        if step == 1:  # killed after step 2's checkpoint, batch 3 sampled ahead
            raise StopIteration

    overlap = OneStepOff()
    straight = _run("copy", 4, async_rollout=overlap, checkpoint=tmp_path / "a", resume="auto")
    _run("copy", 4, async_rollout=overlap, checkpoint=tmp_path / "b", on_step=stop_after_two)
    torch.manual_seed(123)  # whatever happened meanwhile: the checkpoint restores it
    resumed = _run("copy", 4, async_rollout=overlap, checkpoint=tmp_path / "b", resume="auto")
    assert_identical(resumed, straight, steps=4)
    assert untimed(resumed["history"])[2]["async/staleness"] == 1.0


def _ppo_blocks(engine_kind: str):
    torch.manual_seed(0)
    model, tokenizer = rb.models.tiny(seed=0)
    policy = rb.trainer.PolicyTrainer(model, tokenizer=tokenizer, lr=1e-2)  # reference: a copy
    critic = rb.critic.CriticTrainer(model, lr=1e-3)
    engine_model = policy.model if engine_kind == "shared" else copy.deepcopy(model)
    return policy, critic, rb.rollout.HFEngine(engine_model, tokenizer, progress=False)


def _ppo(engine_kind: str, steps: int, **kw) -> dict:
    from toy_tasks import count_prompts, digit_fraction

    policy, critic, engine = _ppo_blocks(engine_kind)
    history = rb.recipes.ppo(
        policy,
        critic,
        engine,
        rb.rewards.per_sample(digit_fraction, timeout=None),
        rb.data.PromptBatches(count_prompts(), prompts_per_step=4, seed=0),
        steps=steps,
        samples_per_prompt=2,
        sampling=rb.SamplingParams(max_new_tokens=8),
        kl_coef=0.01,
        progress=False,
        **kw,
    )
    return {"history": history, "policy": policy.model.state_dict()}


def test_ppo_staleness_zero_is_its_synchronous_loop_and_one_step_off_runs():
    sync = _ppo("copy", 3)
    same = _ppo("copy", 3, async_rollout=OneStepOff(staleness=0))
    for h in same["history"]:
        assert h.pop("async/staleness") == 0.0 and h.pop("async/sample_seconds") > 0
    assert_identical(same, sync, steps=3)
    ahead = _ppo("copy", 3, async_rollout=OneStepOff(old_logprobs="rollout"))["history"]
    assert [h["async/staleness"] for h in ahead] == [0.0, 1.0, 1.0]
    # π_old is the engine's log-probs (nothing scored): no gap between the two; recomputed
    # on a batch sampled by the older weights, it shows one.
    assert all(h["mismatch/abs_max"] == 0.0 for h in ahead)
    recomputed = _ppo("copy", 2, async_rollout=OneStepOff())["history"]
    assert recomputed[1]["mismatch/abs_max"] > 0.1
