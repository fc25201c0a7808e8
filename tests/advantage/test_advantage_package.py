"""The package surface and the name registry: rlblocks/advantage/__init__.py."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import rlblocks.advantage as adv

NEEDS = {
    "gae": lambda b: {"values": b.values},
    "remax": lambda b: {"baseline_rewards": b.rewards * 0.5},
}


def test_public_names_exist():
    for name in adv.__all__:
        assert getattr(adv, name) is not None


@pytest.mark.parametrize("name", sorted(adv.ESTIMATORS))
def test_every_registered_estimator_follows_the_contract(batch, name):
    estimator = adv.ESTIMATORS[name]
    extra = NEEDS.get(name, lambda b: {})(batch)
    for rewards in (batch.rewards, batch.token_rewards):
        before = rewards.clone()
        out = estimator(rewards, batch.mask, batch.group_ids, **extra)
        assert isinstance(out, adv.Advantages)
        advantages, returns = out  # unpacks like a tuple
        for x in (advantages, returns):
            assert x.shape == batch.mask.shape and x.dtype == torch.float32
            assert not x.requires_grad and x.isfinite().all()
            assert (x[~batch.mask] == 0).all()
        assert_close(rewards, before, equal_nan=True)  # inputs untouched


def test_dr_grpo_is_grpo_without_std(batch):
    dr = adv.ESTIMATORS["dr_grpo"](batch.rewards, batch.mask, batch.group_ids)
    plain = adv.grpo(batch.rewards, batch.mask, batch.group_ids, scale_by_std=False)
    assert_close(dr.advantages, plain.advantages)
    # and it differs from GRPO wherever a group's std is not 1
    assert not torch.equal(
        dr.advantages, adv.grpo(batch.rewards, batch.mask, batch.group_ids).advantages
    )
