import math

import pytest
import torch
from torch.testing import assert_close

from rlblocks.losses.value import value_loss


def _random_batch(seed: int, b: int = 6, t: int = 8):
    g = torch.Generator().manual_seed(seed)
    old_values = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = old_values + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    returns = old_values + torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0] = False
    mask[1] = False
    mask[1, 5] = True  # a row with exactly one valid token
    mask[2] = True
    return values, old_values, returns, mask


def test_value_loss_hand_worked():
    # ε = 0.2.
    # t0: V 1.5, V_old 1.0, R 2.0: V_clip = 1.2; (1.5−2)² = 0.25 < (1.2−2)² = 0.64 -> ½·0.64
    #     = 0.32, the clipped term wins, and it is constant in V: gradient 0.
    # t1: V 0.5, V_old 1.0, R 2.0: V_clip = 0.8; (0.5−2)² = 2.25 > (0.8−2)² = 1.44 -> 1.125,
    #     gradient V − R = −1.5.
    # t2: V 1.1, V_old 1.0, R 0.0: inside the clip range, V_clip = V: ½·1.21 = 0.605, grad 1.1.
    # t3: masked (would be ½·(9−0)² = 40.5).
    values = torch.tensor([[1.5, 0.5, 1.1, 9.0]], requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 1.0, 9.0]])
    returns = torch.tensor([[2.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, metrics = value_loss(values, old_values, returns, mask, clip=0.2)
    assert_close(loss.detach(), torch.tensor([[0.32, 1.125, 0.605, 0.0]]))
    loss.sum().backward()
    assert_close(values.grad, torch.tensor([[0.0, -1.5, 1.1, 0.0]]))
    # 1 clipped token of 3 valid; mean V = (1.5 + 0.5 + 1.1)/3
    assert_close(metrics["vf_clip_frac"], torch.tensor(1 / 3))
    assert_close(metrics["values_mean"], torch.tensor(3.1 / 3))
    # explained variance: R = [2, 2, 0], R − V = [0.5, 1.5, −1.1]
    # Var(R) (Bessel): mean 4/3, Σ(R−m)² = 4/9 + 4/9 + 16/9 = 24/9 -> 4/3
    # Var(R−V): mean 0.3, Σ = 0.04 + 1.44 + 1.96 = 3.44 -> 1.72 ; EV = 1 − 1.72/(4/3) = −0.29
    assert_close(metrics["vf_explained_var"], torch.tensor(1 - 1.72 / (4 / 3)))


def test_explained_variance_hand_worked():
    # R = [1, 2, 3], V = [1, 2, 2]: Var(R) = 1, R − V = [0, 0, 1] has variance 1/3 -> EV = 2/3
    values = torch.tensor([[1.0, 2.0, 2.0]])
    returns = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    _, metrics = value_loss(values, values, returns, mask, clip=None)
    assert_close(metrics["vf_explained_var"], torch.tensor(2 / 3))


def _loop_value_loss(values, old_values, returns, mask, clip):
    loss = torch.zeros_like(values)
    clipped_count, n = 0, 0
    for i in range(values.shape[0]):
        for t in range(values.shape[1]):
            if not mask[i, t]:
                continue
            v, old, r = values[i, t].item(), old_values[i, t].item(), returns[i, t].item()
            unclipped = (v - r) ** 2
            if clip is None:
                loss[i, t] = 0.5 * unclipped
                n += 1
                continue
            v_clip = min(max(v, old - clip), old + clip)
            clipped = (v_clip - r) ** 2
            loss[i, t] = 0.5 * max(unclipped, clipped)
            clipped_count += clipped > unclipped
            n += 1
    return loss, clipped_count / n


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("clip", [None, 0.1, 0.3])
def test_value_loss_matches_loop(seed, clip):
    values, old_values, returns, mask = _random_batch(seed)
    loss, metrics = value_loss(values, old_values, returns, mask, clip=clip)
    expected, clip_frac = _loop_value_loss(values, old_values, returns, mask, clip)
    assert_close(loss, expected)
    assert_close(metrics["vf_clip_frac"], torch.tensor(float(clip_frac)))
    # explained variance by the textbook formula on the valid tokens only
    r, v = returns[mask], values[mask]
    ev = 1 - torch.var(r - v) / torch.var(r)
    assert_close(metrics["vf_explained_var"], ev.float())
    assert_close(metrics["values_mean"], v.mean().float())


def test_value_loss_limits():
    values, old_values, returns, mask = _random_batch(5)
    plain = torch.where(mask, 0.5 * (values - returns) ** 2, 0.0)
    # clip=None and a huge clip both give plain ½(V − R)²
    assert_close(value_loss(values, old_values, returns, mask, clip=None)[0], plain)
    assert_close(value_loss(values, old_values, returns, mask, clip=1e6)[0], plain)
    # first epoch, V = V_old: the clip is inactive
    loss, metrics = value_loss(values, values.clone(), returns, mask, clip=0.2)
    assert_close(loss, plain)
    assert_close(metrics["vf_clip_frac"], torch.tensor(0.0))
    # perfect critic that has not moved: zero loss, explained variance 1. (With V = R but V_old
    # far away the clipped term is not zero: the loss is pessimistic by design.)
    loss, metrics = value_loss(returns, returns.clone(), returns, mask, clip=0.2)
    assert_close(loss, torch.zeros_like(loss))
    assert_close(metrics["vf_explained_var"], torch.tensor(1.0))
    # constant returns: explained variance undefined
    _, metrics = value_loss(values, old_values, torch.ones_like(returns), mask)
    assert math.isnan(metrics["vf_explained_var"].item())


def test_value_loss_dtypes_and_detach():
    values = torch.randn(2, 3, dtype=torch.bfloat16, requires_grad=True)
    old_values = torch.randn(2, 3, requires_grad=True)
    returns = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    loss, metrics = value_loss(values, old_values, returns, mask)
    assert loss.dtype == torch.float32
    assert all(m.dtype == torch.float32 and not m.requires_grad for m in metrics.values())
    loss.sum().backward()
    assert values.grad is not None
    assert old_values.grad is None and returns.grad is None


def test_masked_out_nan_never_leaks():
    values, old_values, returns, mask = _random_batch(6)
    dirty = torch.where(mask, values, float("nan")).requires_grad_(True)
    clean = values.clone().requires_grad_(True)
    nan_old = torch.where(mask, old_values, float("nan"))
    nan_ret = torch.where(mask, returns, float("inf"))
    loss, metrics = value_loss(dirty, nan_old, nan_ret, mask)
    clean_loss, clean_metrics = value_loss(clean, old_values, returns, mask)
    assert_close(loss, clean_loss)
    assert_close(metrics, clean_metrics)
    loss.sum().backward()
    clean_loss.sum().backward()
    assert_close(dirty.grad, clean.grad)
