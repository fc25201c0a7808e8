"""One vocabulary across the blocks (rlblocks.renamed): samples per prompt is ``group_size`` and
the KL weight ``kl_coef`` everywhere; an old name fails with a message naming the new one."""

from __future__ import annotations

import inspect

import pytest
import torch

import rlblocks as rb
from rlblocks.renamed import moved_keywords


def test_a_moved_keyword_names_its_replacement_and_the_rest_passes_through():
    @moved_keywords(old="new=")
    def fn(*, new: int = 0) -> int:
        """Doc."""
        return new

    assert fn(new=3) == 3
    assert fn.__doc__ == "Doc." and list(inspect.signature(fn).parameters) == ["new"]
    with pytest.raises(TypeError, match=r"fn: old= is no longer a keyword; use new="):
        fn(old=3)


def test_samples_per_prompt_is_group_size_in_engines_and_recipes():
    model, tokenizer = rb.models.tiny(seed=0)
    engine = rb.rollout.HFEngine(model, tokenizer, progress=False)
    sampling = rb.SamplingParams(max_new_tokens=2, seed=0)
    assert len(engine.generate(["a", "b"], group_size=3, sampling=sampling)) == 6
    with pytest.raises(TypeError, match=r"HFEngine.generate: n= is no longer a keyword; use "):
        engine.generate(["a"], n=2, sampling=sampling)
    for recipe in (rb.recipes.grpo, rb.recipes.ppo, rb.recipes.online_dpo, rb.recipes.distill):
        assert "group_size" in inspect.signature(recipe).parameters, recipe.__name__
    with pytest.raises(TypeError, match=r"ppo: samples_per_prompt= is no longer a keyword"):
        rb.recipes.ppo(None, None, engine, None, [], steps=1, samples_per_prompt=2)


def test_the_kl_weight_is_kl_coef_everywhere():
    loss = rb.losses.kl_regularized(rb.losses.clipped_surrogate, kl_coef=0.1)
    assert callable(loss)
    with pytest.raises(TypeError, match=r"kl_regularized: coef= is no longer a keyword; use kl"):
        rb.losses.kl_regularized(rb.losses.clipped_surrogate, coef=0.1)
    assert rb.losses.FixedKLController(kl_coef=0.2).value == 0.2
    with pytest.raises(TypeError, match=r"AdaptiveKLController.__init__: init_coef= is no"):
        rb.losses.AdaptiveKLController(init_coef=0.1, target=1.0, horizon=10)
    mask = torch.ones(1, 2, dtype=torch.bool)
    lp = torch.zeros(1, 2)
    with pytest.raises(TypeError, match=r"kl_penalty_rewards: coef= is no longer a keyword"):
        rb.losses.kl_penalty_rewards(torch.ones(1), lp, lp, mask, coef=0.1)
    with pytest.raises(TypeError, match=r"distill: coef= is no longer a keyword; use kl_coef="):
        rb.recipes.distill(None, None, None, [], steps=1, coef=1.0)


def test_one_name_one_contract_reverse_kl():
    # The loss's reverse_kl is the per-token estimate; the advantage built from it is teacher_kl.
    assert callable(rb.losses.reverse_kl) and callable(rb.advantage.teacher_kl)
    with pytest.raises(AttributeError, match=r"rlblocks.advantage.reverse_kl: renamed; use "):
        rb.advantage.reverse_kl  # noqa: B018
