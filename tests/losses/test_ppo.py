import math

import pytest
import torch
from loss_cases import INF, NAN, leaf, policy_gradient, random_batch
from torch.testing import assert_close

from rlblocks.losses.ppo import clipped_surrogate

# scale of log r = logp - old in the random batches
SPREAD = 0.5


# ---------------------------------------------------------------- hand-worked values


def test_hand_worked_clip_and_dual_clip():
    # old = 0, so logprobs = log r. clip = (0.2, 0.2), dual clip c = 3.
    ratios = [1.5, 0.5, 1.1, 5.0, 1.0]
    lp = leaf(torch.tensor([[math.log(r) for r in ratios[:4]] + [NAN]]))
    old = torch.zeros(1, 5)
    adv = torch.tensor([[2.0, -1.0, 1.0, -0.5, 7.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    loss, m = clipped_surrogate(lp, old, adv, mask)
    # t0: A=2,  r=1.5: max(-2*1.5, -2*1.2) = max(-3.0, -2.4) = -2.4   (clipped high, no grad)
    # t1: A=-1, r=0.5: max(0.5, 1*0.8) = 0.8; min(0.8, 1*3) = 0.8      (clipped low, no grad)
    # t2: A=1,  r=1.1: max(-1.1, -1.1) = -1.1, inside the clip range    (grad -A*r = -1.1)
    # t3: A=-.5,r=5:   max(2.5, 0.5*1.2=0.6) = 2.5; min(2.5, 0.5*3=1.5) = 1.5 (dual clip, no grad)
    # t4: masked (NaN log-prob) -> 0
    assert_close(loss, torch.tensor([[-2.4, 0.8, -1.1, 1.5, 0.0]]))
    loss.sum().backward()
    assert_close(lp.grad, torch.tensor([[0.0, 0.0, -1.1, 0.0, 0.0]]))
    # 2 of 4 valid tokens clipped (t0 high, t1 low); 1 of 4 dual-clipped (t3).
    assert_close(m["clip_frac"], torch.tensor(0.5))
    assert_close(m["clip_frac_low"], torch.tensor(0.25))
    assert_close(m["clip_frac_high"], torch.tensor(0.25))
    assert_close(m["dual_clip_frac"], torch.tensor(0.25))
    # k1 = mean(-log r) = -log(1.5*0.5*1.1*5)/4 = -log(4.125)/4
    assert_close(m["approx_kl"], torch.tensor(-math.log(4.125) / 4))
    # k3 = mean(r - 1 - log r) = (8.1 - 4 - log 4.125)/4
    assert_close(m["approx_kl_k3"], torch.tensor((8.1 - 4 - math.log(4.125)) / 4))
    assert_close(m["ratio_mean"], torch.tensor(8.1 / 4))  # (1.5+0.5+1.1+5)/4
    assert_close(m["ratio_max"], torch.tensor(5.0))


def test_hand_worked_without_dual_clip():
    # A = -0.5, r = 5: max(-A*r, -A*clip(r)) = max(2.5, 0.6) = 2.5, grad -A*r = 2.5
    lp = leaf(torch.tensor([[math.log(5.0)]]))
    loss, m = clipped_surrogate(
        lp,
        torch.zeros(1, 1),
        torch.tensor([[-0.5]]),
        torch.ones(1, 1, dtype=torch.bool),
        dual_clip=None,
    )
    assert_close(loss, torch.tensor([[2.5]]))
    loss.sum().backward()
    assert_close(lp.grad, torch.tensor([[2.5]]))
    assert_close(m["dual_clip_frac"], torch.tensor(0.0))


def test_clip_higher():
    # A = 1, r = 1.25.  clip (0.2, 0.28): 1.25 < 1.28, unclipped: loss -1.25, grad -A*r = -1.25.
    #                   clip (0.2, 0.2):  clip(r) = 1.2, max(-1.25, -1.2) = -1.2, grad 0.
    old = torch.tensor([[-1.0]])
    adv = torch.tensor([[1.0]])
    mask = torch.tensor([[True]])
    lp = leaf(old + math.log(1.25))
    loss, m = clipped_surrogate(lp, old, adv, mask, clip=(0.2, 0.28))
    loss.sum().backward()
    assert_close(loss, torch.tensor([[-1.25]]))
    assert_close(lp.grad, torch.tensor([[-1.25]]))
    assert_close(m["clip_frac"], torch.tensor(0.0))

    lp = leaf(old + math.log(1.25))
    loss, m = clipped_surrogate(lp, old, adv, mask, clip=(0.2, 0.2))
    loss.sum().backward()
    assert_close(loss, torch.tensor([[-1.2]]))
    assert_close(lp.grad, torch.tensor([[0.0]]))
    assert_close(m["clip_frac_high"], torch.tensor(1.0))


def test_is_weights_multiply_loss_and_gradient():
    # r = 1 (lp == old): loss = -A = [-2, 3]; weights [0.5, 2] -> [-1, 6]; grads -A*w = [-1, 6].
    # The masked weight is NaN and must not leak.
    lp = leaf(torch.tensor([[-1.0, -2.0, NAN]]))
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    adv = torch.tensor([[2.0, -3.0, 1.0]])
    mask = torch.tensor([[True, True, False]])
    w = torch.tensor([[0.5, 2.0, NAN]])
    loss, _ = clipped_surrogate(lp, old, adv, mask, is_weights=w)
    loss.sum().backward()
    assert_close(loss, torch.tensor([[-1.0, 6.0, 0.0]]))
    assert_close(lp.grad, torch.tensor([[-1.0, 6.0, 0.0]]))


# ---------------------------------------------------------------- loop reference


def _reference(lp, old, adv, mask, clip, dual_clip, clamp):
    """Token by token in Python floats: loss, d loss / d logprob, and the two clip flags."""
    b, t = lp.shape
    loss, grad = torch.zeros(b, t), torch.zeros(b, t)
    clipped, dual = torch.zeros(b, t, dtype=torch.bool), torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            a = float(adv[i, j])
            x = float(lp[i, j]) - float(old[i, j])
            in_clamp = -clamp <= x <= clamp
            r = math.exp(min(max(x, -clamp), clamp))
            rc = min(max(r, 1 - clip[0]), 1 + clip[1])
            value, slope = -a * r, (-a * r if in_clamp else 0.0)  # unclipped branch
            if -a * rc > -a * r:  # clipped branch is the larger loss: constant
                value, slope, clipped[i, j] = -a * rc, 0.0, True
            if dual_clip is not None and a < 0 and value > -a * dual_clip:
                value, slope, dual[i, j] = -a * dual_clip, 0.0, True
            loss[i, j], grad[i, j] = value, slope
    return loss, grad, clipped, dual


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("clip", "dual_clip", "clamp"), [((0.2, 0.2), 3.0, 20.0), ((0.2, 0.28), None, 1.0)]
)
def test_matches_loop_reference(seed, clip, dual_clip, clamp):
    lp, old, adv, mask = random_batch(seed, spread=0.8)
    lp_leaf = leaf(lp)
    loss, m = clipped_surrogate(
        lp_leaf, old, adv, mask, clip=clip, dual_clip=dual_clip, log_ratio_clamp=clamp
    )
    loss.sum().backward()
    ref_loss, ref_grad, clipped, dual = _reference(lp, old, adv, mask, clip, dual_clip, clamp)
    assert_close(loss, ref_loss)
    assert_close(lp_leaf.grad, ref_grad)
    n = mask.sum()
    assert_close(m["clip_frac"], clipped.sum() / n)
    assert_close(m["dual_clip_frac"], dual.sum() / n)
    assert_close(m["clip_frac_low"] + m["clip_frac_high"], m["clip_frac"])
    ratios = [
        math.exp(min(max(float(lp[i, j] - old[i, j]), -clamp), clamp))
        for i, j in mask.nonzero().tolist()
    ]
    assert_close(m["ratio_mean"], torch.tensor(sum(ratios) / len(ratios)))
    assert_close(m["ratio_max"], torch.tensor(max(ratios)))


# ---------------------------------------------------------------- limits


@pytest.mark.parametrize("seed", range(3))
def test_ratio_one_is_plain_policy_gradient(seed):
    _, old, adv, mask = random_batch(seed, spread=SPREAD)
    lp = torch.where(mask, old, NAN)  # logprobs == old_logprobs on valid tokens
    lp_leaf = leaf(lp)
    loss, m = clipped_surrogate(lp_leaf, old, adv, mask, clip=(0.2, 0.28))
    _, pg_grad = policy_gradient(lp, old, adv, mask)
    loss.sum().backward()
    # value: -A*r with r = 1 is -A; gradient: -A*r*∇logp = -A*∇logp, that of -A*logp
    assert_close(loss, torch.where(mask, -adv, 0.0))
    assert_close(lp_leaf.grad, pg_grad)
    for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "approx_kl"):
        assert_close(m[key], torch.tensor(0.0))
    assert_close(m["ratio_mean"], torch.tensor(1.0))


def test_dual_clip_caps_huge_ratio_with_zero_gradient():
    # A = -2: cap -A*c = 6. log r = 15 (r ≈ 3.3e6) and 30 (beyond the clamp) both give 6, no grad.
    # A = +2, log r = 15: PPO clip, -A*(1+0.2) = -2.4, no grad.
    lp = leaf(torch.tensor([[15.0, 30.0, 15.0]]))
    loss, m = clipped_surrogate(
        lp, torch.zeros(1, 3), torch.tensor([[-2.0, -2.0, 2.0]]), torch.ones(1, 3, dtype=torch.bool)
    )
    loss.sum().backward()
    assert_close(loss, torch.tensor([[6.0, 6.0, -2.4]]))
    assert_close(lp.grad, torch.zeros(1, 3))
    assert_close(m["dual_clip_frac"], torch.tensor(2 / 3))
    assert torch.isfinite(m["approx_kl_k3"])


def test_masked_tokens_with_inf_and_nan_give_zero_loss_and_gradient():
    lp = leaf(torch.tensor([[-1.0, -INF, NAN, INF]]))
    old = torch.tensor([[-1.5, NAN, -INF, 0.0]])
    adv = torch.tensor([[1.0, NAN, INF, 2.0]])
    mask = torch.tensor([[True, False, False, False]])
    loss, m = clipped_surrogate(lp, old, adv, mask)
    loss.sum().backward()
    # t0: r = e^0.5 = 1.6487 > 1.2 with A = 1 -> clipped: loss -1.2, grad 0
    assert_close(loss, torch.tensor([[-1.2, 0.0, 0.0, 0.0]]))
    assert_close(lp.grad, torch.zeros(1, 4))
    assert all(torch.isfinite(v) for v in m.values())


def test_no_valid_token_gives_zero_loss_and_metrics():
    lp = leaf(torch.full((2, 3), NAN))
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, m = clipped_surrogate(lp, torch.zeros(2, 3), torch.ones(2, 3), mask)
    loss.sum().backward()
    assert_close(loss, torch.zeros(2, 3))
    assert_close(lp.grad, torch.zeros(2, 3))
    for value in m.values():
        assert_close(value, torch.tensor(0.0))


def test_bf16_input_is_computed_in_float32():
    lp, old, adv, mask = random_batch(0, spread=SPREAD)
    lp16 = leaf(lp.bfloat16())
    loss, m = clipped_surrogate(lp16, old, adv, mask)
    assert loss.dtype == torch.float32
    ref, _ = clipped_surrogate(lp16.detach().float(), old, adv, mask)
    assert_close(loss, ref)
    loss.sum().backward()
    assert lp16.grad.dtype == torch.bfloat16
    assert all(
        v.dtype == torch.float32 and v.dim() == 0 and not v.requires_grad for v in m.values()
    )


def test_old_logprobs_and_advantages_are_detached():
    lp, old, adv, mask = random_batch(1, spread=SPREAD)
    old, adv = leaf(old), leaf(adv)
    loss, _ = clipped_surrogate(leaf(lp), old, adv, mask)
    loss.sum().backward()
    assert old.grad is None and adv.grad is None


def test_bad_inputs_raise():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="bool"):
        clipped_surrogate(x, x, x, mask.float())
    with pytest.raises(ValueError, match="shape"):
        clipped_surrogate(x, x, torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_surrogate(x, x, x, mask, dual_clip=0.5)
