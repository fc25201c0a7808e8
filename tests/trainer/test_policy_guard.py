"""The NaN/inf guard: a non-finite loss or gradient skips the update and changes nothing."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from builders import tiny_trainer

from rlblocks.losses import clipped_surrogate


def _nan_loss(lp, loss):
    return loss * float("nan")  # a NaN value (and NaN gradients)


def _inf_grad(lp, loss):
    lp.register_hook(lambda g: g * float("inf"))  # a finite value, an infinite gradient
    return loss


def _snapshot(trainer):
    return (
        {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        copy.deepcopy(trainer.optimizer.state_dict()),
    )


def _assert_same(trainer, snapshot):
    weights, optimizer = snapshot
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, weights[name]), name  # bit-identical
    now = trainer.optimizer.state_dict()
    assert now["state"].keys() == optimizer["state"].keys()
    for key, state in optimizer["state"].items():
        for field, value in state.items():
            assert torch.equal(now["state"][key][field], value), (key, field)
    assert all(p.grad is None for p in trainer.model.parameters())


@pytest.mark.parametrize("poison", [_nan_loss, _inf_grad])
def test_bad_minibatch_is_skipped(make_rollouts, poison):
    ro = make_rollouts(seed=0)
    trainer = tiny_trainer(lr=1e-2, mini_batch_size=4)
    trainer.step(ro, torch.randn(8), loss_fn=clipped_surrogate)  # 2 good updates: Adam state
    seen = []

    def loss_fn(lp, old, adv, mask, /):
        seen.append(_snapshot(trainer))  # state before this mini-batch's update
        loss, metrics = clipped_surrogate(lp, old, adv, mask)
        return (poison(lp, loss) if len(seen) == 2 else loss), metrics

    with pytest.warns(RuntimeWarning, match="optimizer step skipped"):
        out = trainer.step(ro, torch.randn(8), loss_fn=loss_fn)
    # Mini-batch 1 was applied, mini-batch 2 skipped: the state is the one mini-batch 2 saw.
    _assert_same(trainer, seen[1])
    assert out["optimizer_steps"] == 1 and out["skipped_steps"] == 1
    assert trainer.optimizer_steps == 3 and trainer.skipped_steps == 1
    assert trainer.scheduler.last_epoch == 3  # the schedule did not advance on the skip
    assert math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"])  # good step only


def test_every_step_skipped_leaves_everything_bit_identical(make_rollouts):
    ro = make_rollouts(seed=1)
    trainer = tiny_trainer(lr=1e-2)
    trainer.step(ro, torch.randn(8), loss_fn=clipped_surrogate)
    before = _snapshot(trainer)

    def loss_fn(lp, old, adv, mask, /):
        loss, metrics = clipped_surrogate(lp, old, adv, mask)
        return _nan_loss(lp, loss), metrics

    with pytest.warns(RuntimeWarning):
        out = trainer.step(ro, torch.randn(8), loss_fn=loss_fn)
    _assert_same(trainer, before)
    assert out["optimizer_steps"] == 0 and out["skipped_steps"] == 1
    assert math.isnan(out["loss"])  # nothing applied: no metric to report
