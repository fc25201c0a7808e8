import math

import pytest
import torch
from loss_cases import INF, NAN, leaf, random_batch
from torch.testing import assert_close

from rlblocks.losses.gpg import gpg_loss

# scale of log r = logp - old in the random batches
SPREAD = 0.5


def test_hand_worked():
    lp = leaf(torch.tensor([[-0.5, -2.0, NAN]]))
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
    lp, old, adv, mask = random_batch(seed, spread=SPREAD)
    lp_leaf = leaf(lp)
    w = torch.where(mask, torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed)), NAN)
    loss, _ = gpg_loss(lp_leaf, old, adv, mask, is_weights=w)
    loss.sum().backward()
    ref_loss, ref_grad = torch.zeros(lp.shape), torch.zeros(lp.shape)
    for i, j in mask.nonzero().tolist():
        a, wt = float(adv[i, j]), float(w[i, j])
        ref_loss[i, j] = -a * float(lp[i, j]) * wt
        ref_grad[i, j] = -a * wt
    assert_close(loss, ref_loss)
    assert_close(lp_leaf.grad, ref_grad)


@pytest.mark.parametrize("seed", range(3))
def test_old_logprobs_do_not_change_the_loss(seed):
    lp, old, adv, mask = random_batch(seed, spread=SPREAD)
    far = torch.where(mask, old - 5.0, NAN)
    assert_close(gpg_loss(lp, old, adv, mask)[0], gpg_loss(lp, far, adv, mask)[0])


def test_limits_zero_advantage_and_equal_policies():
    lp, old, _, mask = random_batch(0, spread=SPREAD)
    lp_leaf = leaf(lp)
    loss, _ = gpg_loss(lp_leaf, old, torch.zeros(lp.shape), mask)
    loss.sum().backward()
    assert_close(loss, torch.zeros(lp.shape))
    assert_close(lp_leaf.grad, torch.zeros(lp.shape))
    _, m = gpg_loss(old.clone(), old, torch.ones(lp.shape), mask)
    assert_close(m["approx_kl"], torch.tensor(0.0))
    assert_close(m["approx_kl_k3"], torch.tensor(0.0))
    assert_close(m["ratio_max"], torch.tensor(1.0))


def test_masked_inf_nan_and_dtypes():
    lp = leaf(torch.tensor([[-1.0, -INF, NAN]]).bfloat16())
    old = torch.tensor([[-1.0, NAN, INF]])
    adv = torch.tensor([[2.0, INF, NAN]])
    mask = torch.tensor([[True, False, False]])
    loss, m = gpg_loss(lp, old, adv, mask)
    loss.sum().backward()
    assert loss.dtype == torch.float32
    assert_close(loss, torch.tensor([[2.0, 0.0, 0.0]]))
    assert_close(lp.grad.float(), torch.tensor([[-2.0, 0.0, 0.0]]))
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in m.values())
