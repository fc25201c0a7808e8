"""`rlblocks.trainer.config.apply_config`: a trainer that loads a saved state trains with its own
`TrainConfig`, not with the saved learning rate, schedule, betas, eps and weight decay.

A trainer takes two steps and is saved (``save_checkpoint``, ``state_dict``); a trainer built
with other settings loads it. Its optimizer and schedule must then hold its own settings, with
the schedule at the restored optimizer step: the learning rate in effect is ``lr · schedule(k)``
for the new ``lr`` and ``schedule`` at k = 2, computed here from the schedule object itself.
"""

from __future__ import annotations

import pytest
import torch
from builders import tiny_trainer

import rlblocks as rb
from rlblocks.losses import clipped_surrogate
from rlblocks.trainer.schedules import cosine, warmup_constant

SAVED = {"lr": 1e-2, "schedule": warmup_constant(warmup=5), "weight_decay": 0.0}
ASKED = {
    "lr": 1e-3,
    "schedule": cosine(warmup=1, total=6, min_ratio=0.1),
    "betas": (0.8, 0.99),
    "eps": 1e-6,
    "weight_decay": 0.05,
}


def trained(make_rollouts, build):
    """A trainer built by ``build`` after two steps (two optimizer steps)."""
    trainer = build(**SAVED)
    for seed in (1, 2):
        trainer.step(make_rollouts(seed=seed), torch.randn(8), loss_fn=clipped_surrogate)
    assert trainer.optimizer_steps == 2
    return trainer


def assert_in_effect(trainer) -> None:
    """The trainer's own settings on its optimizer and schedule, at the restored step."""
    config, k = trainer.config, trainer.optimizer_steps
    assert k == 2 and trainer.scheduler.last_epoch == k  # the step count is state: restored
    expected_lr = config.lr * config.schedule(k)  # 1e-3 · (cosine 1 step into 5 of decay)
    assert trainer.scheduler.get_last_lr() == [expected_lr]
    assert trainer.scheduler.base_lrs == [config.lr]
    (group,) = trainer.optimizer.param_groups
    assert group["lr"] == expected_lr and group["initial_lr"] == config.lr
    assert group["betas"] == config.betas and group["eps"] == config.eps
    assert group["weight_decay"] == config.weight_decay
    assert config.schedule == cosine(warmup=1, total=6, min_ratio=0.1)  # not overwritten
    assert trainer.optimizer.state  # AdamW's moments are state: restored, not reset


def test_a_loaded_checkpoint_trains_with_the_trainers_own_settings(tmp_path, make_rollouts):
    saved = trained(make_rollouts, tiny_trainer)
    saved.save_checkpoint(tmp_path)
    resumed = tiny_trainer(**ASKED)
    resumed.load_checkpoint(tmp_path)
    assert_in_effect(resumed)
    metrics = resumed.step(make_rollouts(seed=3), torch.randn(8), loss_fn=clipped_surrogate)
    assert metrics["lr"] == resumed.config.lr * resumed.config.schedule(2)  # the update's lr


def test_a_loaded_state_dict_trains_with_the_trainers_own_settings(make_rollouts):
    resumed = tiny_trainer(**ASKED)
    resumed.load_state_dict(trained(make_rollouts, tiny_trainer).state_dict())
    assert_in_effect(resumed)


@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
def test_a_loaded_critic_trains_with_its_own_settings(tmp_path, make_rollouts, how):
    model, _ = rb.models.tiny(seed=0)

    def critic(**settings):
        return rb.critic.CriticTrainer(model, **settings)

    saved = critic(**SAVED)
    for seed in (1, 2):
        ro = make_rollouts(seed=seed)
        saved.step(ro, torch.randn(ro.response_mask.shape), old_values=saved.values(ro))
    resumed = critic(**ASKED)
    if how == "checkpoint":
        saved.save_checkpoint(tmp_path)
        resumed.load_checkpoint(tmp_path)
    else:
        resumed.load_state_dict(saved.state_dict())
    assert_in_effect(resumed)


def test_the_adam_update_after_a_resume_scales_with_the_new_lr(tmp_path, make_rollouts):
    # AdamW's update from a given state is -lr·m̂/(√v̂ + ε) - lr·λ·w: linear in lr. So from
    # one restored state and one batch, the update of a trainer loaded with lr/10 must be a
    # tenth of the update of one loaded with the saved lr (float64: exact but for rounding).
    saved = trained(make_rollouts, lambda **s: tiny_trainer(torch.float64, **s))
    saved.save_checkpoint(tmp_path)
    start = {n: p.detach().clone() for n, p in saved.model.named_parameters()}
    ro, adv = make_rollouts(seed=3), torch.randn(8)
    updates = {}
    for lr in (1e-2, 1e-3):
        trainer = tiny_trainer(torch.float64, **{**SAVED, "lr": lr})
        trainer.load_checkpoint(tmp_path)
        trainer.step(ro, adv, loss_fn=clipped_surrogate)
        updates[lr] = {n: p.detach() - start[n] for n, p in trainer.model.named_parameters()}
    assert any(u.abs().max() > 0 for u in updates[1e-2].values())  # the update moved weights
    for name, update in updates[1e-2].items():
        torch.testing.assert_close(updates[1e-3][name], update / 10, msg=name)
