import math

import pytest
import torch
from torch.testing import assert_close

from rlblocks.losses.gpg import gpg_loss

NAN, INF = float("nan"), float("inf")


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _random_batch(seed: int, b: int = 6, t: int = 7):
    """Random inputs; row 0 has exactly one valid token, row 1 none; masked entries poisoned."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3 - 0.05
    lp = old + 0.5 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0] = False
    mask[0, 3] = True
    mask[1] = False
    lp = torch.where(mask, lp, NAN)
    old = torch.where(mask, old, -INF)
    adv = torch.where(mask, adv, NAN)
    return lp, old, adv, mask


def test_hand_worked():
    lp = _leaf(torch.tensor([[-0.5, -2.0, NAN]]))
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    mask = torch.tensor([[True, True, False]])
    loss, m = gpg_loss(lp, old, adv, mask)
    loss.sum().backward()
    # loss = -A*logp: -2*(-0.5) = 1.0, -(-1)*(-2) = -2.0; masked 0. grad = -A = [-2, 1, 0]
    assert_close(loss, torch.tensor([[1.0, -2.0, 0.0]]))
    assert_close(lp.grad, torch.tensor([[-2.0, 1.0, 0.0]]))
    # log r = [0.5, 0]: k1 = mean(-log r) = -0.25; ratio mean = (e^0.5 + 1)/2
    assert_close(m["approx_kl"], torch.tensor(-0.25))
    assert_close(m["ratio_mean"], torch.tensor((math.exp(0.5) + 1) / 2))
    assert_close(m["ratio_max"], torch.tensor(math.exp(0.5)))


@pytest.mark.parametrize("seed", range(5))
def test_matches_loop_reference(seed):
    lp, old, adv, mask = _random_batch(seed)
    leaf = _leaf(lp)
    w = torch.where(mask, torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed)), NAN)
    loss, _ = gpg_loss(leaf, old, adv, mask, is_weights=w)
    loss.sum().backward()
    ref_loss, ref_grad = torch.zeros(lp.shape), torch.zeros(lp.shape)
    for i, j in mask.nonzero().tolist():
        a, wt = float(adv[i, j]), float(w[i, j])
        ref_loss[i, j] = -a * float(lp[i, j]) * wt
        ref_grad[i, j] = -a * wt
    assert_close(loss, ref_loss)
    assert_close(leaf.grad, ref_grad)


@pytest.mark.parametrize("seed", range(3))
def test_old_logprobs_do_not_change_the_loss(seed):
    lp, old, adv, mask = _random_batch(seed)
    far = torch.where(mask, old - 5.0, NAN)
    assert_close(gpg_loss(lp, old, adv, mask)[0], gpg_loss(lp, far, adv, mask)[0])


def test_limits_zero_advantage_and_equal_policies():
    lp, old, _, mask = _random_batch(0)
    leaf = _leaf(lp)
    loss, _ = gpg_loss(leaf, old, torch.zeros(lp.shape), mask)
    loss.sum().backward()
    assert_close(loss, torch.zeros(lp.shape))
    assert_close(leaf.grad, torch.zeros(lp.shape))
    _, m = gpg_loss(old.clone(), old, torch.ones(lp.shape), mask)
    assert_close(m["approx_kl"], torch.tensor(0.0))
    assert_close(m["approx_kl_k3"], torch.tensor(0.0))
    assert_close(m["ratio_max"], torch.tensor(1.0))


def test_masked_inf_nan_and_dtypes():
    lp = _leaf(torch.tensor([[-1.0, -INF, NAN]]).bfloat16())
    old = torch.tensor([[-1.0, NAN, INF]])
    adv = torch.tensor([[2.0, INF, NAN]])
    mask = torch.tensor([[True, False, False]])
    loss, m = gpg_loss(lp, old, adv, mask)
    loss.sum().backward()
    assert loss.dtype == torch.float32
    assert_close(loss, torch.tensor([[2.0, 0.0, 0.0]]))
    assert_close(lp.grad.float(), torch.tensor([[-2.0, 0.0, 0.0]]))
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in m.values())
