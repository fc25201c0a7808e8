"""Rollout-versus-trainer mismatch metrics and truncated importance sampling, by hand."""

import math
from functools import partial

import pytest
import torch
from builders import tiny_engine, tiny_trainer

import rlblocks as rb
from rlblocks.losses import TruncatedIS, clipped_surrogate, rollout_mismatch
from rlblocks.losses.inputs import loss_inputs

MASK = torch.tensor([[True, True, False]])


def test_mismatch_metrics_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, 0.0]])
    rollout = torch.tensor([[-1.5, -2.0, -9.0]])  # the masked third token must not count
    got = rollout_mismatch(logprobs, rollout, MASK)
    # d = (0.5, 0): mean |d| 0.25, max 0.5; k3 = e^d - 1 - d = (e^0.5 - 1.5, 0) averaged.
    assert got["mismatch/abs_mean"] == pytest.approx(0.25)
    assert got["mismatch/abs_max"] == pytest.approx(0.5)
    assert got["mismatch/kl"] == pytest.approx((math.exp(0.5) - 1.5) / 2)
    assert got["mismatch/ratio_mean"] == pytest.approx((math.exp(0.5) + 1) / 2)
    assert got["mismatch/outside"] == 0.0  # e^0.5 = 1.65 is inside [1/2, 2]
    far = rollout_mismatch(torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.7, -0.5]]), MASK[:, :2])
    assert far["mismatch/outside"] == 0.5  # ratios e^0.7 = 2.01 (outside) and e^-0.5 = 0.61
    empty = rollout_mismatch(logprobs, rollout, torch.zeros_like(MASK))
    assert all(math.isnan(v) for v in empty.values())


def test_truncated_is_weights_the_inner_loss_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-2.0, -1.9, -3.0]])  # ratios e^1 = 2.72 -> capped at 2, e^-0.1
    advantages = torch.tensor([[1.0, -1.0, 5.0]])
    inner = partial(clipped_surrogate, clip=(0.2, 0.2))
    loss, metrics = TruncatedIS(inner, cap=2.0)(
        logprobs, old, advantages, MASK, rollout_logprobs=rollout
    )
    weights = torch.tensor([[2.0, math.exp(-0.1), 1.0]])
    expected, _ = inner(logprobs, old, advantages, MASK, is_weights=weights)
    torch.testing.assert_close(loss, expected)
    # ratio 1 at the first update: the surrogate is -A per token, times the weight.
    torch.testing.assert_close(loss[0, :2], torch.tensor([-2.0, math.exp(-0.1)]))
    assert metrics["tis/capped_frac"] == pytest.approx(0.5)
    assert metrics["tis/weight_mean"] == pytest.approx((2.0 + math.exp(-0.1)) / 2)


def test_the_trainer_logs_the_mismatch_and_takes_a_tis_loss():
    policy = tiny_trainer()
    engine = tiny_engine(policy)  # shares the weights
    ro = engine.generate(
        ["Count: 1", "Count: 2"], group_size=4, sampling=rb.SamplingParams(max_new_tokens=6, seed=0)
    )
    adv = torch.linspace(-1, 1, ro.batch_size)
    loss = TruncatedIS(partial(clipped_surrogate, clip=(0.2, 0.28)), cap=2.0)
    metrics = policy.step(ro, adv, loss_fn=loss)
    assert metrics["mismatch/abs_max"] < 1e-5  # same weights, same precision
    assert metrics["tis/weight_mean"] == pytest.approx(1.0, abs=1e-5)
    # The engine's log-probs from before the update are now stale: the next step sees it.
    metrics = policy.step(ro, adv, loss_fn=loss)
    assert metrics["mismatch/abs_max"] > 1e-3 and metrics["mismatch/kl"] > 0
    assert metrics["tis/weight_mean"] != pytest.approx(1.0, abs=1e-4)


def test_a_tis_loss_makes_the_trainer_score_no_reference_and_no_entropy():
    # TruncatedIS takes **kwargs to pass on what its inner loss takes; read as such it took
    # everything: the trainer ran the reference model over the batch and computed the entropy
    # for a loss that reads neither. Its signature now names rollout_logprobs and what the
    # inner loss takes.
    loss = TruncatedIS(partial(clipped_surrogate, clip=(0.2, 0.28)), cap=2.0)
    assert loss_inputs(loss).accepted == {"rollout_logprobs"}
    assert loss_inputs(loss).required == {"rollout_logprobs"}
    policy = tiny_trainer(reference="copy")
    forwards = []
    policy.reference.register_forward_hook(lambda *_: forwards.append(1))
    ro = tiny_engine(policy).generate(
        ["Count: 1", "Count: 2"], group_size=4, sampling=rb.SamplingParams(max_new_tokens=6, seed=0)
    )
    metrics = policy.step(ro, torch.linspace(-1, 1, ro.batch_size), loss_fn=loss)
    assert forwards == [] and "entropy" not in metrics
    assert metrics["tis/weight_mean"] == pytest.approx(1.0, abs=1e-5)  # the loss did run
    # An inner loss that reads the reference still gets it (scored by that same model).
    policy.step(ro, torch.zeros(ro.batch_size), loss_fn=TruncatedIS(kl_loss_on_top, cap=2.0))
    assert forwards


def kl_loss_on_top(logprobs, old_logprobs, advantages, mask, /, *, ref_logprobs, is_weights):
    """A surrogate plus a k3 KL term, weighted per token: an inner loss that reads π_ref."""
    pg, metrics = clipped_surrogate(logprobs, old_logprobs, advantages, mask, is_weights=is_weights)
    kl, _ = rb.losses.kl_loss(logprobs, ref_logprobs, mask)
    return pg + 0.1 * kl, metrics
