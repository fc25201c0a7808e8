"""`AgentEngine` on the real HF engine with the tiny model: the rows hold exactly the sampled ids
and the template's observation ids, the masks exclude every observation token, and a GRPO step
on them is the step on their single-turn equivalent."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from agent_cases import (
    PROMPTS,
    SAMPLING,
    RecordingHFEngine,
    ScriptedEnv,
    chatml_observation,
    expected_rows,
    model_segments,
    split_into_turns,
)
from builders import tiny_trainer

import rlblocks as rb
from rlblocks.envs import AgentEngine

LOSS = partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28))


@pytest.fixture
def sampled():
    """Two-turn episodes of `ScriptedEnv` on a float64 tiny policy's own module."""
    policy = tiny_trainer(torch.float64, max_grad_norm=None)
    engine = RecordingHFEngine(policy.model, policy.tokenizer, chat=True, progress=False)
    agent = AgentEngine(engine, ScriptedEnv(turns=2), max_turns=3)
    metadata = [{"ground_truth": str(i)} for i in range(len(PROMPTS))]
    ro = agent.generate(PROMPTS, group_size=2, sampling=SAMPLING, metadata=metadata)
    return policy, engine, agent, ro


def test_rows_are_the_sampled_ids_plus_the_observation_ids(sampled):
    policy, engine, _, ro = sampled
    ends = [m["agent"]["end"] for m in ro.metadata]
    assert ends.count("done") >= 2, ends  # some episodes reached their second turn
    assert len(engine.calls) == 2  # one batched engine call per turn
    for r, row in enumerate(expected_rows(engine, ro, policy.tokenizer)):
        real = ro.response_attention_mask[r]
        assert ro.response_ids[r][real].tolist() == row["ids"], r
        assert ro.response_mask[r][real].tolist() == row["mask"], r
        assert ro.rollout_logprobs[r][real].tolist() == row["logprobs"], r
        turns = ro.metadata[r]["agent"]["turns"]
        assert len(model_segments(row["mask"])) == turns
    # Nothing counts outside the real tokens, and observation tokens have rollout log-prob 0.
    observation = ro.response_attention_mask & ~ro.response_mask
    assert observation.any()
    assert (ro.rollout_logprobs[observation] == 0).all()
    assert (ro.rollout_logprobs[ro.response_mask] < 0).all()


def test_turn_two_is_sampled_from_exactly_the_row_so_far(sampled):
    # Token in, token out: each prompt of the second call is a first-call prompt + that row's
    # sampled ids + the observation, never a re-tokenization of the decoded text.
    policy, engine, _, _ = sampled
    (first_prompts, first), (second_prompts, _) = engine.calls
    continued = []
    for k, prompt in enumerate(first_prompts):
        sampled_ids = first.response_ids[k][first.response_mask[k]].tolist()
        observation = chatml_observation(policy.tokenizer, sampled_ids, "Observation 0: go on")
        continued.append(prompt + sampled_ids + observation)
    assert second_prompts and all(p in continued for p in second_prompts)


def test_groups_metadata_and_episode_info(sampled):
    _, _, _, ro = sampled
    assert ro.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    for r, meta in enumerate(ro.metadata):
        assert meta["ground_truth"] == str(r // 2)
        info = meta["agent"]
        assert info["end"] in rb.envs.ENDS
        # ScriptedEnv's final reward is the number of turns it was shown: all of them, but a
        # cut-off last turn, which the environment never sees.
        assert info["reward"] == float(info["turns"] - (info["end"] == "truncated"))
        assert info["messages"][0] == {"role": "user", "content": PROMPTS[r // 2]}
        assert info["answer"] == info["messages"][-1]["content"]
        # Per-turn rewards 0.25, 0.5 sit on the last token of each model turn.
        real = ro.response_attention_mask[r]
        segments = model_segments(ro.response_mask[r][real].tolist())
        placed = ro.extras["turn_rewards"][r]
        expected = torch.zeros_like(placed)
        for k, reward in enumerate(info["turn_rewards"]):
            expected[segments[k][1] - 1] = reward
            assert reward == 0.25 * (k + 1)
        assert torch.equal(placed, expected)


def test_env_reward_and_agent_metrics(sampled):
    _, _, _, ro = sampled
    rewards, metrics = rb.envs.env_reward(ro)
    expected = [m["agent"]["reward"] for m in ro.metadata]
    assert rewards.tolist() == expected and rewards.dtype == torch.float32
    turns = [m["agent"]["turns"] for m in ro.metadata]
    assert metrics["agent/turns"] == sum(turns) / len(turns)
    assert metrics["agent/end/done"] + metrics["agent/end/truncated"] == pytest.approx(1.0)
    observation = (ro.response_attention_mask & ~ro.response_mask).sum()
    assert metrics["agent/observation_tokens"] == float(observation) / len(ro)
    plain = rb.rollout.HFEngine(*rb.models.tiny(seed=0), progress=False).generate(
        PROMPTS[:1], sampling=rb.SamplingParams(max_new_tokens=2)
    )
    with pytest.raises(ValueError, match="row 0 has no metadata\\['agent'\\]"):
        rb.envs.env_reward(plain)


def test_trainer_scores_model_tokens_as_in_their_single_turn_rows(sampled):
    policy, _, _, ro = sampled
    split, _ = split_into_turns(ro, torch.zeros(ro.response_ids.shape))
    multi = policy.logprobs(ro)[ro.response_mask]
    single = policy.logprobs(split)[split.response_mask]
    # Same ids, same positions, same context; float64 model, float32 output: only the order of
    # additions differs between the two batch layouts, far below float32 resolution.
    torch.testing.assert_close(multi, single)
    # And the engine sampled with these weights: its log-probs are the trainer's (float64 model
    # on both sides, cached against uncached attention: float32 rounding of the result).
    torch.testing.assert_close(ro.rollout_logprobs[ro.response_mask], multi)


# Deep copies of a trainer carry a scheduler whose link to the copied optimizer's step torch
# no longer sees; it warns, and nothing else changes.
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_grpo_step_equals_the_step_on_the_single_turn_equivalent(sampled):
    policy, _, _, ro = sampled
    rewards, _ = rb.envs.env_reward(ro)
    # + 0.1·row: no group has equal rewards, so every row has a non-zero advantage.
    rewards = rewards + 0.1 * torch.arange(len(ro))
    advantages, _ = rb.advantage.grpo(rewards, ro.response_mask, ro.group_ids)
    # GRPO's per-row advantage sits on the model tokens, exactly 0 on observation tokens.
    observation = ro.response_attention_mask & ~ro.response_mask
    assert (advantages[observation] == 0).all() and advantages[ro.response_mask].abs().sum() > 0
    split, split_advantages = split_into_turns(ro, advantages)
    trainers = [copy.deepcopy(policy) for _ in range(4)]
    grads = [gradients_at_step(trainer) for trainer in trainers]
    everything = [torch.arange(len(ro))]
    ro_old = ro.replace(old_logprobs=ro.rollout_logprobs)  # π_old travels with the rows
    multi = trainers[0].step(ro_old, advantages, loss_fn=LOSS, minibatches=everything)
    single = trainers[1].step(
        split.replace(old_logprobs=split.rollout_logprobs),
        split_advantages,
        loss_fn=LOSS,
        minibatches=[torch.arange(len(split))],
    )
    # Token-mean over the same model tokens with the same inputs: the same loss and gradient.
    # The forward passes agree exactly (float64 model, same ids and positions); the loss is
    # float32 by design (rlblocks.losses), and float32 exp / products / divisions round a token
    # differently (by an ulp, 2^-24 ≈ 6e-8 relative each) depending on where it sits in the
    # batch (vectorized or scalar kernel path). A token's gradient seed so carries ~3 such
    # roundings, ~2e-7, summed over rows into each gradient entry: 1e-6 of the largest entry
    # bounds it (measured: 2.3e-8). Training one observation token, or shifting a position,
    # moves the gradient by whole percents (the negative control below).
    assert multi["loss"] == pytest.approx(single["loss"], rel=1e-6)
    assert multi["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-6)
    g_multi, g_single = grads[0][0], grads[1][0]
    scale = float(g_multi.abs().max())
    assert scale > 0
    torch.testing.assert_close(g_single, g_multi, rtol=1e-6, atol=1e-6 * scale)
    # The negative control: the same rows with the observation tokens counted in the loss.
    per_row = advantages.sum(-1) / ro.response_mask.sum(-1)
    trained_observations = ro.replace(response_mask=ro.response_attention_mask)
    trainers[3].step(
        trained_observations.replace(old_logprobs=ro.rollout_logprobs),
        per_row,
        loss_fn=LOSS,
        minibatches=everything,
    )
    assert (grads[3][0] - g_multi).abs().max() > 1e-2 * scale
    # Observation tokens contribute nothing: other advantages and π_old there change no bit.
    noisy_adv = torch.where(observation, 100.0, advantages)
    noisy_old = torch.where(observation, -5.0, ro.rollout_logprobs)
    noisy = trainers[2].step(
        ro.replace(old_logprobs=noisy_old), noisy_adv, loss_fn=LOSS, minibatches=everything
    )
    assert noisy["loss"] == multi["loss"] and noisy["grad_norm"] == multi["grad_norm"]
    assert torch.equal(grads[2][0], g_multi)
    after_multi = dict(trainers[0].model.named_parameters())
    for name, value in trainers[2].model.named_parameters():
        assert torch.equal(after_multi[name], value), name


def gradients_at_step(trainer: rb.trainer.PolicyTrainer) -> list[torch.Tensor]:
    """A list that receives, at each optimizer step of ``trainer``, all its gradients
    flattened into one vector (an optimizer step pre-hook: read just before AdamW uses them)."""
    seen: list[torch.Tensor] = []

    def keep(optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        seen.append(torch.cat([p.grad.detach().flatten().clone() for p in params]))

    trainer.optimizer.register_step_pre_hook(keep)
    return seen


def test_max_turns_ends_before_the_observation():
    policy = tiny_trainer(max_grad_norm=None)
    engine = RecordingHFEngine(policy.model, policy.tokenizer, chat=True, progress=False)
    ro = AgentEngine(engine, ScriptedEnv(turns=5), max_turns=1).generate(PROMPTS, sampling=SAMPLING)
    [(_, only)] = engine.calls
    for r in range(len(ro)):  # the rows are the engine's answer, as it gave it
        real, sampled = ro.response_attention_mask[r], only.response_mask[r]
        assert ro.response_ids[r][real].tolist() == only.response_ids[r][sampled].tolist()
        assert ro.response_mask[r][real].all()
    ends = {m["agent"]["end"] for m in ro.metadata}
    assert ends <= {"max_turns", "truncated"} and "max_turns" in ends


def test_max_total_tokens_keeps_every_row_within_it():
    policy = tiny_trainer(max_grad_norm=None)
    engine = RecordingHFEngine(policy.model, policy.tokenizer, chat=True, progress=False)
    probe = AgentEngine(engine, ScriptedEnv(turns=3))
    longest = max(len(probe.chat.prompt(ScriptedEnv().reset(p, {}))[1]) for p in PROMPTS)
    # Room for the first turn and 5 more tokens: no observation (> 10 ids) fits with a turn.
    limit = longest + SAMPLING.max_new_tokens + 5
    agent = AgentEngine(engine, ScriptedEnv(turns=3), max_turns=3, max_total_tokens=limit)
    ro = agent.generate(PROMPTS, group_size=2, sampling=SAMPLING)
    assert int(ro.attention_mask.sum(-1).max()) <= limit
    ends = [m["agent"]["end"] for m in ro.metadata]
    assert set(ends) <= {"max_tokens", "truncated"} and "max_tokens" in ends
    assert not (ro.response_attention_mask & ~ro.response_mask).any()  # no observation added
    with pytest.raises(ValueError, match="prompt 0 .* passes max_total_tokens=20"):
        AgentEngine(engine, ScriptedEnv(), max_total_tokens=20).generate(PROMPTS, sampling=SAMPLING)


def test_a_cut_off_turn_ends_the_episode_without_asking_the_environment():
    policy = tiny_trainer(max_grad_norm=None)
    engine = RecordingHFEngine(policy.model, policy.tokenizer, chat=True, progress=False)
    # No stop string, and the tiny model almost never samples EOS (p ≈ 1/384 a token).
    sampling = rb.SamplingParams(max_new_tokens=4, seed=0)
    ro = AgentEngine(engine, ScriptedEnv(turns=3)).generate(PROMPTS, sampling=sampling)
    for meta in ro.metadata:
        assert meta["agent"]["end"] == "truncated" and meta["agent"]["turns"] == 1
        assert meta["agent"]["reward"] == 0.0  # ScriptedEnv.step never saw a turn
        assert meta["agent"]["messages"][-1]["role"] == "assistant"  # the cut turn is kept
    assert len(engine.calls) == 1


def test_seeded_calls_are_reproducible():
    policy = tiny_trainer(max_grad_norm=None)
    agent = AgentEngine(
        rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True, progress=False),
        ScriptedEnv(turns=2),
    )
    a = agent.generate(PROMPTS, group_size=2, sampling=SAMPLING)
    b = agent.generate(PROMPTS, group_size=2, sampling=SAMPLING)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.response_mask, b.response_mask)


def test_weights_reach_the_wrapped_engine_through_the_resharder():
    policy = tiny_trainer(max_grad_norm=None)
    separate = rb.rollout.HFEngine(*rb.models.tiny(seed=0), chat=True, progress=False)
    agent = AgentEngine(separate, ScriptedEnv())
    ro = agent.generate(PROMPTS, group_size=2, sampling=SAMPLING)
    policy.step(ro, torch.linspace(-1, 1, len(ro)), loss_fn=LOSS)
    before = separate.model.model.embed_tokens.weight.clone()
    metrics = rb.resharder.Resharder().sync(policy, agent)
    assert metrics["sync/bytes"] > 0 and separate.weights_version == 1
    assert not torch.equal(before, separate.model.model.embed_tokens.weight)
    for name, value in policy.model.state_dict().items():
        assert torch.equal(separate.model.state_dict()[name], value), name
    # A wrapped engine sharing the policy's module stays shared: nothing is copied.
    shared = AgentEngine(rb.rollout.HFEngine(policy.model, policy.tokenizer), ScriptedEnv())
    assert shared.model is policy.model
    assert rb.resharder.Resharder().sync(policy, shared)["sync/bytes"] == 0


def test_the_grpo_recipe_runs_on_the_agent_engine_unchanged():
    policy = tiny_trainer(max_grad_norm=None)
    engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True, progress=False)
    agent = AgentEngine(engine, ScriptedEnv(turns=2))
    data = rb.data.arithmetic_prompts(n=8, chat=True)
    batches = rb.data.PromptBatches(data, prompts_per_step=2)
    history = rb.recipes.grpo(
        policy,
        agent,
        rb.envs.env_reward,
        batches,
        steps=1,
        group_size=2,
        sampling=SAMPLING,
        run=rb.run.RunOptions(progress=False),
    )
    (metrics,) = history
    assert metrics["agent/turns"] >= 1.0 and "agent/end/done" in metrics
    assert metrics["optimizer_steps"] == 1
