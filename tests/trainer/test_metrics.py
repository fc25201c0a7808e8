"""Token-weighted metric averages, and dropping the metrics of skipped steps."""

from __future__ import annotations

import math

import torch
from torch.testing import assert_close

from rlblocks.trainer.metrics import StepMetrics


def test_token_weighted_average_hand_worked():
    m = StepMetrics()
    t = torch.tensor
    # mini-batch 1: micro-batches of 3 and 1 tokens, clip_frac 0.2 and 0.6, losses 0.5 + 0.25
    m.add_micro_batch(t(0.5), {"clip_frac": t(0.2), "entropy": t(1.0)}, tokens=t(3))
    m.add_micro_batch(t(0.25), {"clip_frac": t(0.6), "entropy": t(2.0)}, tokens=t(1))
    m.commit(t(4.0))
    # mini-batch 2: one micro-batch of 4 tokens, clip_frac 0.0, loss 1.25
    m.add_micro_batch(t(1.25), {"clip_frac": t(0.0), "entropy": t(3.0)}, tokens=t(4))
    m.commit(t(2.0))
    out = m.summary()
    # clip_frac = (0.2·3 + 0.6·1 + 0.0·4) / 8 = 1.2 / 8 = 0.15
    # entropy   = (1·3 + 2·1 + 3·4) / 8 = 17 / 8 = 2.125
    # loss      = mean(0.5 + 0.25, 1.25) = 1.0;  grad_norm = mean(4, 2) = 3
    assert_close(out, {"clip_frac": 0.15, "entropy": 2.125, "loss": 1.0, "grad_norm": 3.0})


def test_discarded_minibatch_is_not_counted():
    m = StepMetrics()
    t = torch.tensor
    m.add_micro_batch(t(1.0), {"kl": t(0.5), "entropy": t(1.0)}, tokens=t(2))
    m.commit(t(1.0))
    m.add_micro_batch(t(float("nan")), {"kl": t(float("nan")), "entropy": t(9.0)}, tokens=t(5))
    m.discard()
    assert_close(m.summary(), {"kl": 0.5, "entropy": 1.0, "loss": 1.0, "grad_norm": 1.0})


def test_nothing_committed_gives_nan():
    out = StepMetrics().summary()
    assert math.isnan(out["loss"]) and math.isnan(out["grad_norm"])
