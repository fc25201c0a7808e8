"""One vocabulary across the blocks: samples per prompt is ``group_size`` and the KL weight
``kl_coef`` everywhere (an old keyword is Python's plain "unexpected keyword argument")."""

from __future__ import annotations

import inspect

import pytest
import torch

import rlblocks as rb


def test_samples_per_prompt_is_group_size_in_engines_and_recipes():
    model, tokenizer = rb.models.tiny(seed=0)
    engine = rb.rollout.HFEngine(model, tokenizer, progress=False)
    sampling = rb.SamplingParams(max_new_tokens=2, seed=0)
    assert len(engine.generate(["a", "b"], group_size=3, sampling=sampling)) == 6
    for recipe in (rb.recipes.grpo, rb.recipes.ppo, rb.recipes.online_dpo, rb.recipes.distill):
        assert "group_size" in inspect.signature(recipe).parameters, recipe.__name__
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'samples_per_prompt'"):
        rb.recipes.ppo(None, None, engine, None, [], steps=1, samples_per_prompt=2)


def test_the_kl_weight_is_kl_coef_everywhere():
    loss = rb.losses.kl_regularized(rb.losses.clipped_surrogate, kl_coef=0.1)
    assert callable(loss)
    assert rb.losses.FixedKLController(kl_coef=0.2).value == 0.2
    controller = rb.losses.AdaptiveKLController(init_kl_coef=0.1, target=1.0, horizon=10)
    assert controller.value == 0.1
    mask = torch.ones(1, 2, dtype=torch.bool)
    lp = torch.zeros(1, 2)
    rb.losses.kl_penalty_rewards(torch.ones(1), lp, lp, mask, kl_coef=0.1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'coef'"):
        rb.recipes.distill(None, None, None, [], steps=1, coef=1.0)


def test_one_name_one_contract_reverse_kl():
    # The loss's reverse_kl is the per-token estimate; the advantage built from it is teacher_kl.
    assert callable(rb.losses.reverse_kl) and callable(rb.advantage.teacher_kl)
    assert not hasattr(rb.advantage, "reverse_kl")
