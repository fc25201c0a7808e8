"""Reference log-probs, and the optional loss inputs (ref_logprobs, entropy) reaching the loss."""

from __future__ import annotations

import pytest
import torch
from builders import tiny_trainer
from torch.testing import assert_close

from rlblocks.losses import clipped_surrogate, entropy_loss, kl_loss


def test_frozen_copy_stays_fixed(make_rollouts):
    ro = make_rollouts(seed=0)
    trainer = tiny_trainer(reference="auto", lr=1e-2)  # "auto" without LoRA: a frozen copy
    ref0, lp0 = trainer.ref_logprobs(ro), trainer.logprobs(ro)
    assert_close(ref0, lp0)  # policy == reference before training
    for _ in range(2):
        trainer.step(ro, torch.randn(8), loss_fn=clipped_surrogate)
    assert torch.equal(trainer.ref_logprobs(ro), ref0)
    assert (trainer.logprobs(ro) - lp0).abs().max() > 1e-3
    assert not any(p.requires_grad for p in trainer.reference.parameters())


def test_loss_receives_ref_logprobs_and_entropy(make_rollouts):
    ro = make_rollouts(seed=1)
    trainer = tiny_trainer(reference="auto", lr=1e-3)
    expected_ref = trainer.ref_logprobs(ro)
    _, expected_entropy = trainer.logprobs(ro, entropy=True)
    seen = {}

    def loss_fn(lp, old, adv, mask, /, *, ref_logprobs, entropy):
        seen.update(ref=ref_logprobs, entropy=entropy)
        pg, metrics = clipped_surrogate(lp, old, adv, mask)
        kl, kl_metrics = kl_loss(lp, ref_logprobs, mask)
        bonus, _ = entropy_loss(entropy, mask)
        return pg + 0.1 * kl + 0.01 * bonus, {**metrics, **kl_metrics}

    out = trainer.step(ro, torch.randn(8), loss_fn=loss_fn)
    # One mini-batch, rows in order, one micro-batch: the loss saw the whole batch.
    assert_close(seen["ref"], expected_ref)
    assert seen["entropy"].requires_grad
    real = ro.response_attention_mask
    assert_close(seen["entropy"].detach()[real].float(), expected_entropy[real])
    # k3 = r − 1 − log r with r = π_ref / π_θ = 1 at the first update: exactly 0 up to rounding
    # (the policy forward runs on the same weights as the reference copy).
    assert_close(out["kl"], 0.0)


def test_entropy_bonus_gradient_raises_entropy(make_rollouts):
    # Limit: a loss made only of −H must increase the mean entropy.
    ro = make_rollouts(seed=2)
    trainer = tiny_trainer(lr=1e-2)

    def loss_fn(lp, old, adv, mask, /, *, entropy):
        return entropy_loss(entropy, mask)

    first = trainer.step(ro, torch.zeros(8), loss_fn=loss_fn)["entropy"]
    second = trainer.step(ro, torch.zeros(8), loss_fn=loss_fn)["entropy"]
    assert second > first + 1e-3


def test_missing_reference_is_an_error_unless_given_in_extras(make_rollouts):
    ro = make_rollouts(seed=3)
    trainer = tiny_trainer(lr=0.0)

    def loss_fn(lp, old, adv, mask, /, *, ref_logprobs):
        return kl_loss(lp, ref_logprobs, mask)

    with pytest.raises(ValueError, match="no reference"):
        trainer.step(ro, torch.zeros(8), loss_fn=loss_fn)
    with pytest.raises(ValueError, match="no reference"):
        trainer.ref_logprobs(ro)
    # Reference log-probs computed elsewhere (a separate ref worker) arrive through extras:
    # ref = lp − 0.5 gives k3 = e^{−0.5} − 1 + 0.5 = 0.10653 on every token.
    given = ro.replace(ref_logprobs=trainer.logprobs(ro) - 0.5)
    out = trainer.step(given, torch.zeros(8), loss_fn=loss_fn)
    # float32 log-probs: (lp − 0.5) − lp differs from −0.5 by ~1 ulp of lp (5e-7): atol 1e-5.
    assert_close(out["kl"], 0.10653, atol=1e-5, rtol=0)


def test_loss_receives_rollout_logprobs(make_rollouts):
    ro = make_rollouts(seed=4)
    trainer = tiny_trainer(lr=0.0)

    def loss_fn(lp, old, adv, mask, /, *, rollout_logprobs):
        # Truncated importance weight min(π_old / π_rollout, 2) as in the rollout/trainer
        # mismatch correction; with rollout = old − 1 every weight is min(e, 2) = 2.
        weights = torch.exp(old - rollout_logprobs).clamp(max=2.0)
        loss, metrics = clipped_surrogate(lp, old, adv, mask, is_weights=weights)
        return loss, {**metrics, "is_weight": weights[mask].mean()}

    with pytest.raises(ValueError, match="rollout_logprobs"):
        trainer.step(ro, torch.zeros(8), loss_fn=loss_fn)
    old = trainer.logprobs(ro)
    with_rollout = ro.replace(rollout_logprobs=old - 1.0)
    out = trainer.step(with_rollout.replace(old_logprobs=old), torch.zeros(8), loss_fn=loss_fn)
    assert_close(out["is_weight"], 2.0)
