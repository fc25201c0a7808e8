"""Batch whitening over valid tokens: rlblocks/advantage/whiten.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlblocks.advantage.whiten import whiten

VALUES = torch.tensor([[1.0, 2.0, 3.0, 100.0], [float("nan"), 4.0, 2.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)


def test_hand_worked():
    # valid values 1, 2, 3, 4, 2: mean 12 / 5 = 2.4
    # squared deviations 1.96, 0.16, 0.36, 2.56, 0.16 -> sum 5.2, unbiased var 5.2 / 4 = 1.3
    scale = 1 / math.sqrt(1.3 + 1e-8)
    expected = torch.tensor(
        [[-1.4 * scale, -0.4 * scale, 0.6 * scale, 0.0], [0.0, 1.6 * scale, -0.4 * scale, 0.0]]
    )
    assert_close(whiten(VALUES, MASK), expected)
    # shift_mean=False adds the mean 2.4 back on the valid tokens
    kept = torch.where(MASK, expected + 2.4, 0.0)
    assert_close(whiten(VALUES, MASK, shift_mean=False), kept)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_matches_loop_reference(batch, shift_mean):
    flat = []
    for values_row, mask_row in zip(batch.values.tolist(), batch.mask.tolist()):
        flat += [v for v, m in zip(values_row, mask_row) if m]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    expected = []
    for values_row, mask_row in zip(batch.values.tolist(), batch.mask.tolist()):
        row = []
        for v, m in zip(values_row, mask_row):
            w = (v - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
            row.append(w if m else 0.0)
        expected.append(row)
    out = whiten(batch.values, batch.mask, shift_mean=shift_mean)
    assert_close(out, torch.tensor(expected))


def test_limits(batch):
    out = whiten(batch.values, batch.mask)
    valid = out[batch.mask]
    # whitened valid tokens have mean 0 and unbiased variance 1 (up to eps = 1e-8)
    assert_close(valid.mean(), torch.tensor(0.0))
    assert_close(valid.var(), torch.tensor(1.0))
    assert (out[~batch.mask] == 0).all()
    # whitening twice changes nothing more
    assert_close(whiten(out, batch.mask), out)
    # a single valid token has nothing to spread: 0; no valid token at all: all zeros
    one = torch.zeros(2, 3, dtype=torch.bool)
    one[1, 2] = True
    assert (whiten(torch.randn(2, 3), one) == 0).all()
    assert (whiten(torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool)) == 0).all()


def test_pure_and_detached():
    values = VALUES.clone().requires_grad_(True)
    before = values.detach().clone()
    out = whiten(values, MASK)
    assert not out.requires_grad
    assert out.dtype == torch.float32
    assert_close(values.detach(), before, equal_nan=True)
    half = whiten(VALUES.nan_to_num().bfloat16(), MASK)
    assert half.dtype == torch.float32
