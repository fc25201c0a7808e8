"""Learning-rate multipliers at hand-worked steps, a loop reference, and their limits."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlblocks.trainer.schedules import constant, cosine, warmup_constant


def test_constant():
    assert [constant()(k) for k in (0, 1, 100)] == [1.0, 1.0, 1.0]


def test_warmup_constant_hand_worked():
    s = warmup_constant(warmup=4)
    # k = 0..3: (k + 1) / 4 = 0.25, 0.5, 0.75, 1.0; then 1.0 for good.
    assert [s(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_constant(warmup=0)(0) == 1.0  # no warmup


def test_cosine_hand_worked():
    s = cosine(warmup=2, total=6, min_ratio=0.1)
    # warmup: k = 0, 1 -> 1/2, 2/2.
    # decay over total - warmup = 4 steps, m = 0.1 + 0.9 · ½(1 + cos(π · (k − 2) / 4)):
    #   k = 2: cos 0 = 1        -> 0.1 + 0.9 · 1     = 1.0
    #   k = 3: cos π/4 = 0.7071 -> 0.1 + 0.9 · 0.8536 = 0.86820
    #   k = 4: cos π/2 = 0      -> 0.1 + 0.9 · 0.5    = 0.55
    #   k = 5: cos 3π/4         -> 0.1 + 0.9 · 0.1464 = 0.23180
    #   k = 6: cos π = −1       -> 0.1;  k = 9: held at 0.1
    got = [s(k) for k in (0, 1, 2, 3, 4, 5, 6, 9)]
    expected = [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1, 0.1]
    # The hand values are rounded to 4 decimals: compare at that precision.
    assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)


def test_cosine_matches_loop_reference():
    for warmup, total, rho in [(0, 10, 0.0), (3, 20, 0.2), (5, 5, 0.5)]:
        s = cosine(warmup=warmup, total=total, min_ratio=rho)
        for k in range(total + 3):
            if k < warmup:
                expected = (k + 1) / warmup
            elif total == warmup:
                expected = rho  # a decay of zero length ends at once
            else:
                frac = min(k - warmup, total - warmup) / (total - warmup)
                expected = rho + (1 - rho) * (1 + math.cos(math.pi * frac)) / 2
            if total == warmup and k == warmup:
                expected = 1.0  # progress 0/max(1, 0) = 0: the first post-warmup step is full
            assert_close(s(k), expected)


def test_cosine_limits():
    s = cosine(warmup=0, total=8, min_ratio=1.0)  # min_ratio 1: a constant schedule
    assert [s(k) for k in range(10)] == [1.0] * 10
    assert cosine(warmup=0, total=4)(0) == 1.0 and cosine(warmup=0, total=4)(4) == 0.0


def test_schedules_reject_bad_arguments():
    with pytest.raises(ValueError):
        warmup_constant(warmup=-1)
    with pytest.raises(ValueError):
        cosine(warmup=5, total=2)
    with pytest.raises(ValueError):
        cosine(warmup=0, total=2, min_ratio=1.5)
