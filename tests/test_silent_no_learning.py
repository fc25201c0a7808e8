"""Silent no-learning is reported where it happens: groups of one, transposed advantages, a
model broken by a too-large update."""

from __future__ import annotations

import logging

import pytest
import torch
from builders import tiny_engine, tiny_trainer

import rlblocks as rb


def _engine_and_policy(lr: float = 1e-2):
    torch.manual_seed(0)
    policy = tiny_trainer(lr=lr)
    return tiny_engine(policy), policy


@pytest.mark.parametrize(
    "estimator",
    [rb.advantage.grpo, rb.advantage.rloo, rb.advantage.opo, rb.advantage.grpo_passk,
     rb.advantage.reinforce_pp_baseline],
)  # fmt: skip
def test_groups_of_one_are_reported_at_every_call(estimator, caplog):
    rewards, mask = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.ones(4, 3, dtype=torch.bool)
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            advantages, _ = estimator(rewards, mask, torch.tensor([7, 3, 5, 1]))
        assert "every group has one row (4 rows, 4 distinct group ids)" in caplog.text
        assert "n=G) with G >= 2" in caplog.text
        assert not advantages.any()  # the reason: nothing to learn from
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        estimator(rewards, mask, torch.tensor([0, 0, 1, 1]))
    assert caplog.text == ""


def test_square_advantages_passed_transposed_are_refused():
    engine, policy = _engine_and_policy()
    ro = engine.generate(
        ["Count: 1", "Count: 2"], group_size=2, sampling=rb.SamplingParams(max_new_tokens=4)
    )
    ro = ro.replace(
        response_mask=torch.arange(4)[None, :]
        < torch.tensor([4, 2, 3, 1])[:, None]  # not symmetric
    )
    b, t = ro.response_mask.shape
    assert b == t == 4
    advantages, _ = rb.advantage.grpo(
        torch.tensor([1.0, 0.0, 0.5, 0.2]), ro.response_mask, ro.group_ids
    )
    loss = rb.recipes.defaults.PPO_CLIP
    with pytest.raises(ValueError, match="advantages look transposed"):
        policy.step(ro, advantages.T, loss_fn=loss)
    assert policy.step(ro, advantages, loss_fn=loss)["optimizer_steps"] == 1.0  # rows first


def test_a_model_broken_by_its_update_is_named_at_the_next_generate():
    # lr 1e10: the guard passes (finite loss and gradient), the weights reach ~1e10 and the next
    # forward overflows; before, generate died in torch.multinomial ("probability tensor
    # contains either inf, nan or element < 0") without a word about the cause.
    engine, policy = _engine_and_policy(lr=1e10)
    sampling = rb.SamplingParams(max_new_tokens=4)
    ro = engine.generate(["Count: 1"], group_size=4, sampling=sampling)
    metrics = policy.step(
        ro, torch.tensor([1.0, -1.0, 1.0, -1.0]), loss_fn=rb.recipes.defaults.PPO_CLIP
    )
    assert metrics["optimizer_steps"] == 1.0 and metrics["skipped_steps"] == 0.0
    with pytest.raises(FloatingPointError, match="; lower lr, set max_grad_norm"):
        engine.generate(["Count: 1"], group_size=4, sampling=sampling)
    greedy = rb.SamplingParams(max_new_tokens=4, temperature=0.0)  # greedy would go on silently
    with pytest.raises(
        FloatingPointError, match="^HFEngine.generate: the model's next-token scores are not finite"
    ):
        engine.generate(["Count: 1"], group_size=1, sampling=greedy)
