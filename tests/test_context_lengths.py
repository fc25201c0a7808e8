"""Lengths are checked against the model's context before any compute, in every engine and in
the trainer; the error names the row, its lengths and what to change."""

from __future__ import annotations

import pytest
import torch
from builders import tiny_engine, tiny_trainer

import rlblocks as rb
from rlblocks.models import check_lengths, context_length


def _blocks(context: int):
    policy = tiny_trainer(model_config={"max_position_embeddings": context})  # a short context
    return policy, tiny_engine(policy)


def test_context_length_reads_the_config():
    model, _ = rb.models.tiny(seed=0)
    assert context_length(model) == model.config.max_position_embeddings
    assert context_length(object()) is None  # unknown: nothing is checked
    check_lengths([10**9], new_tokens=10, limit=None, owner="x")


def test_the_engine_refuses_a_prompt_past_the_context_before_generating():
    _, engine = _blocks(context=40)
    short, long = "Count: 1", "Count: " + " ".join(str(i) for i in range(40))
    ids = [len(i) for i in engine.tokenizer([short, long])["input_ids"]]
    assert ids[0] + 8 <= 40 < ids[1]
    with pytest.raises(ValueError, match=rf"prompt 1 has {ids[1]} tokens, which is longer than"):
        engine.generate([short, long], sampling=rb.SamplingParams(max_new_tokens=8))
    budget = 40 - ids[0] + 1  # the short prompt alone fits, not with this many new tokens
    with pytest.raises(ValueError, match=rf"plus max_new_tokens={budget} passes the model's "):
        engine.generate([short], sampling=rb.SamplingParams(max_new_tokens=budget))
    ro = engine.generate([short], sampling=rb.SamplingParams(max_new_tokens=budget - 1))
    assert ro.attention_mask.sum() <= 40  # at the limit: fine


def test_the_trainer_refuses_rows_past_the_context_before_its_forward():
    policy, engine = _blocks(context=64)
    ro = engine.generate(
        ["Count: 1", "Count: 2"], group_size=2, sampling=rb.SamplingParams(max_new_tokens=8)
    )
    policy.model.config.max_position_embeddings = int(ro.attention_mask.sum(-1).max()) - 1
    with pytest.raises(ValueError, match=r"row \d has \d+ tokens, past the model's context"):
        policy.logprobs(ro)
    with pytest.raises(ValueError, match="past the model's context"):
        policy.step(ro, torch.ones(4), loss_fn=rb.recipes.defaults.PPO_CLIP)
    assert policy.optimizer_steps == 0


def test_the_critic_refuses_rows_past_the_context_before_its_forward():
    policy, engine = _blocks(context=64)
    critic = rb.critic.CriticTrainer(policy.model)
    ro = engine.generate(["Count: 1"], group_size=2, sampling=rb.SamplingParams(max_new_tokens=8))
    critic.model.backbone.config.max_position_embeddings = int(ro.attention_mask.sum(-1).max()) - 1
    with pytest.raises(ValueError, match=r"ValueModel: row \d has \d+ tokens, past the model's"):
        critic.values(ro)
