"""Every GRPO-family variant learns end to end: the tiny model on the digit-fraction task
(tests/recipes/test_grpo.py's), each variant against its lr-0 control, over two seeds.

The variants the other tests show learning (GRPO, RLOO, REINFORCE++-baseline, Dr.GRPO, ReMax,
DAPO, PPO) are not repeated here; these are the ones whose math was unit-tested only.

The update takes 4 mini-batches of 8 rows and 2 epochs per batch (8 optimizer steps): with one
on-policy step the ratio π_θ/π_old is 1 everywhere and GSPO, CISPO and GPG give GRPO's gradient
exactly (their trajectories were identical in a first measurement), so the losses are only
told apart, and tested, once later mini-batches are off-policy.

The bar, from a first measurement (seeds 0 and 1, lr 3e-3, 20 steps; tests' helper run on one
thread): learned, the mean reward of the last 3 steps was 0.917 at the lowest (KL-Cov, seed 0)
and 0.958 to 1.000 for the others; the lr-0 controls never passed 0.051 at any step. The bar
sits halfway, at 0.5, for the learned run's last 3 steps, and 0.1 (twice the control's highest)
for every step of the control.

At lr 0 no variant's loss or advantage reaches the weights, so its control samples the initial
model's rewards whatever the variant: the control is run once per seed and shared
(`test_the_lr_0_control_is_the_same_for_every_variant` runs two variants' and compares).
"""

from __future__ import annotations

import functools

import pytest
import torch
from builders import tiny_engine, tiny_trainer
from toy_tasks import run_group_recipe

import rlblocks as rb

VARIANTS = {
    "gspo": {"loss_fn": rb.losses.gspo},  # sequence-level ratio, its own tiny clip range
    "cispo": {"loss_fn": rb.losses.cispo},  # clipped IS weight, every token's gradient kept
    "gpg": {"advantage": rb.advantage.gpg, "loss_fn": rb.losses.gpg_loss},  # no ratio
    "opo": {"advantage": rb.advantage.opo},  # length-weighted optimal baseline
    "clip_cov": {"loss_fn": rb.losses.clip_cov},  # high-covariance tokens detached
    "kl_cov": {"loss_fn": rb.losses.kl_cov},  # high-covariance tokens KL-penalised
    "reinforce_pp": {"advantage": rb.advantage.reinforce_pp},  # token-level, batch-whitened
    "grpo_passk": {"advantage": rb.advantage.grpo_passk},  # pass@k advantage
}
LEARNED = 0.5
CONTROL = 0.1


def rewards(variant: dict, *, lr: float, seed: int) -> list[float]:
    """20 steps of GRPO with ``variant``'s advantage and loss; the mean reward of each step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = tiny_trainer(lr=lr, seed=seed, mini_batch_size=8, epochs=2)
        engine = tiny_engine(policy)
        history = run_group_recipe(rb.recipes.grpo, policy, engine, steps=20, **variant)
    return [h["reward/mean"] for h in history]


@functools.cache
def control(seed: int) -> tuple[float, ...]:
    """The lr-0 control of ``seed`` (any variant's: the first one's)."""
    return tuple(rewards(next(iter(VARIANTS.values())), lr=0.0, seed=seed))


def test_the_lr_0_control_is_the_same_for_every_variant():
    assert tuple(rewards(VARIANTS["kl_cov"], lr=0.0, seed=0)) == control(0)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_variant_learns_where_its_lr_0_control_does_not(name, seed):
    learned = rewards(VARIANTS[name], lr=3e-3, seed=seed)
    unlearned = control(seed)
    assert max(unlearned) < CONTROL, unlearned  # without updates the reward stays where it was
    assert sum(learned[:3]) / 3 < CONTROL, learned  # it starts there too
    assert sum(learned[-3:]) / 3 > LEARNED, learned


def test_the_losses_are_told_apart_by_off_policy_updates():
    # The point of the mini-batches: on the same seed, GSPO, CISPO and GPG now follow
    # different trajectories (with one on-policy step they were the same to the last digit).
    runs = {name: rewards(VARIANTS[name], lr=3e-3, seed=0) for name in ("gspo", "cispo", "gpg")}
    assert runs["gspo"] != runs["cispo"] != runs["gpg"] != runs["gspo"]
