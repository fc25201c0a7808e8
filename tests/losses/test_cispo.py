import math

import pytest
import torch
from loss_cases import INF, NAN, leaf, policy_gradient, random_batch
from torch.testing import assert_close

from rlblocks.losses.cispo import cispo
from rlblocks.losses.ppo import clipped_surrogate

# scale of log r = logp - old in the random batches: wide, so many weights get clipped
SPREAD = 0.8


# ---------------------------------------------------------------- hand-worked values


def test_hand_worked():
    # old = -1 everywhere; clip (0.2, 0.28) -> weight clipped to [0.8, 1.28]
    old = torch.full((1, 4), -1.0)
    log_r = [math.log(0.5), math.log(2.0), math.log(1.1)]
    lp = leaf(torch.tensor([[-1.0 + x for x in log_r] + [NAN]]))
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, m = cispo(lp, old, adv, mask, clip=(0.2, 0.28))
    loss.sum().backward()
    # t0: r = 0.5 -> w = 0.8;  loss = -0.8 * 1 * (-1 + log 0.5) = 0.8 * 1.693147 = 1.354518
    #     grad = -w*A = -0.8
    # t1: r = 2 -> w = 1.28;   loss = -1.28 * (-1) * (-1 + log 2) = 1.28 * -0.306853 = -0.392772
    #     grad = -w*A = 1.28
    # t2: r = 1.1 -> w = 1.1;  loss = -1.1 * 2 * (-1 + log 1.1) = 2.2 * 0.904690 = 1.990318
    #     grad = -w*A = -2.2
    expected = [0.8 * (1 - log_r[0]), -1.28 * (1 - log_r[1]), 2.2 * (1 - log_r[2]), 0.0]
    assert_close(loss, torch.tensor([expected]))
    assert_close(lp.grad, torch.tensor([[-0.8, 1.28, -2.2, 0.0]]))
    # t0 clipped low, t1 clipped high: 2 of 3 valid tokens
    assert_close(m["clip_frac"], torch.tensor(2 / 3))
    assert_close(m["clip_frac_low"], torch.tensor(1 / 3))
    assert_close(m["clip_frac_high"], torch.tensor(1 / 3))
    assert_close(m["ratio_mean"], torch.tensor((0.5 + 2.0 + 1.1) / 3))


def test_default_clip_has_no_lower_bound_and_caps_at_five():
    # defaults (1.0, 4.0): weight in [0, 5]. r = 0.1 keeps w = 0.1; r = 8 gets w = 5.
    # lp = 0 + log r with old = 0, A = 1: grad = -w; loss = -w * log r.
    lp = leaf(torch.tensor([[math.log(0.1), math.log(8.0)]]))
    loss, m = cispo(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool))
    loss.sum().backward()
    assert_close(loss, torch.tensor([[-0.1 * math.log(0.1), -5.0 * math.log(8.0)]]))
    assert_close(lp.grad, torch.tensor([[-0.1, -5.0]]))
    assert_close(m["clip_frac_high"], torch.tensor(0.5))
    assert_close(m["clip_frac_low"], torch.tensor(0.0))


# ---------------------------------------------------------------- loop reference


def _reference(lp, old, adv, mask, clip, clamp):
    b, t = lp.shape
    loss, grad = torch.zeros(b, t), torch.zeros(b, t)
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                x = float(lp[i, j]) - float(old[i, j])
                r = math.exp(min(max(x, -clamp), clamp))
                w = min(max(r, 1 - clip[0]), 1 + clip[1])
                loss[i, j] = -w * float(adv[i, j]) * float(lp[i, j])
                grad[i, j] = -w * float(adv[i, j])
    return loss, grad


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("clip", "clamp"), [((1.0, 4.0), 20.0), ((0.2, 0.28), 0.5)])
def test_matches_loop_reference(seed, clip, clamp):
    lp, old, adv, mask = random_batch(seed, spread=SPREAD)
    lp_leaf = leaf(lp)
    loss, m = cispo(lp_leaf, old, adv, mask, clip=clip, log_ratio_clamp=clamp)
    loss.sum().backward()
    ref_loss, ref_grad = _reference(lp, old, adv, mask, clip, clamp)
    assert_close(loss, ref_loss)
    assert_close(lp_leaf.grad, ref_grad)
    r = torch.exp((lp - old).clamp(-clamp, clamp))[mask]
    outside = (r < 1 - clip[0]) | (r > 1 + clip[1])
    assert_close(m["clip_frac"], outside.float().mean())


# ---------------------------------------------------------------- limits


@pytest.mark.parametrize("seed", range(3))
def test_ratio_one_is_plain_policy_gradient(seed):
    _, old, adv, mask = random_batch(seed, spread=SPREAD)
    lp = torch.where(mask, old, NAN)
    lp_leaf = leaf(lp)
    loss, m = cispo(lp_leaf, old, adv, mask, clip=(0.2, 0.28))
    pg, pg_grad = policy_gradient(lp, old, adv, mask)
    loss.sum().backward()
    # weight sg[clip(1)] = 1: value and gradient are those of -A*logp exactly
    assert_close(loss, pg)
    assert_close(lp_leaf.grad, pg_grad)
    assert_close(m["clip_frac"], torch.tensor(0.0))


def test_far_off_policy_token_keeps_gradient_unlike_ppo():
    # r = e^1 = 2.718 > 1.28, A = 1: PPO clips (grad 0); CISPO keeps grad -w*A = -1.28.
    old = torch.tensor([[-2.0]])
    lp = torch.tensor([[-1.0]])
    adv, mask = torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool)
    ppo_leaf, cispo_leaf = leaf(lp), leaf(lp)
    clipped_surrogate(ppo_leaf, old, adv, mask, clip=(0.2, 0.28))[0].sum().backward()
    cispo(cispo_leaf, old, adv, mask, clip=(0.2, 0.28))[0].sum().backward()
    assert_close(ppo_leaf.grad, torch.zeros(1, 1))
    assert_close(cispo_leaf.grad, torch.tensor([[-1.28]]))


def test_masked_tokens_with_inf_and_nan_give_zero_loss_and_gradient():
    lp = leaf(torch.tensor([[-1.0, -INF, NAN, INF]]))
    old = torch.tensor([[-1.0, NAN, -INF, 0.0]])
    adv = torch.tensor([[2.0, NAN, INF, 1.0]])
    mask = torch.tensor([[True, False, False, False]])
    w = torch.tensor([[1.0, NAN, INF, NAN]])
    loss, m = cispo(lp, old, adv, mask, is_weights=w)
    loss.sum().backward()
    # t0: r = 1, w = 1: loss = -1 * 2 * (-1) = 2, grad = -2
    assert_close(loss, torch.tensor([[2.0, 0.0, 0.0, 0.0]]))
    assert_close(lp.grad, torch.tensor([[-2.0, 0.0, 0.0, 0.0]]))
    assert all(torch.isfinite(v) for v in m.values())


def test_bf16_input_and_detached_metrics():
    lp, old, adv, mask = random_batch(3, spread=SPREAD)
    lp_leaf = leaf(lp.bfloat16())
    loss, m = cispo(lp_leaf, old, adv, mask)
    assert loss.dtype == torch.float32
    assert_close(loss, cispo(lp.bfloat16().float(), old, adv, mask)[0])
    assert all(
        v.dtype == torch.float32 and v.dim() == 0 and not v.requires_grad for v in m.values()
    )
