import math

import pytest
import torch
from loss_cases import INF, NAN, leaf, policy_gradient, random_batch
from torch.testing import assert_close

from rlblocks.losses.gspo import gspo

# scale of log r = logp - old in the random batches: small, sequence ratios stay near 1
# (the batches use row_advantage=True: GSPO is used with sequence-level rewards)
SPREAD = 0.05


# ---------------------------------------------------------------- hand-worked values


def test_hand_worked():
    # clip = (0.1, 0.1): the sequence ratio s is clipped to [0.9, 1.1].
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-2.0, 0.0, 0.0]])
    lr = torch.tensor([[0.3, -0.1, 0.1], [0.2, -0.4, 0.0], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    lp = leaf(torch.where(mask, old + lr, NAN))
    adv = torch.tensor([[1.0] * 3, [2.0] * 3, [-1.0] * 3])
    loss, m = gspo(lp, old, adv, mask, clip=(0.1, 0.1))
    loss.sum().backward()
    # row 0: log s = (0.3 - 0.1 + 0.1)/3 = 0.1, s = e^0.1 = 1.105171; A = 1:
    #        max(-1.105171, -1.1) = -1.1 on each token (clipped, no gradient)
    # row 1: log s = (0.2 - 0.4)/2 = -0.1, s = e^-0.1 = 0.904837 inside [0.9, 1.1]; A = 2:
    #        loss -2*s = -1.809675 per valid token, gradient -A*s = -1.809675 per token
    # row 2: one token, s = e^0.5 = 1.648721; A = -1: max(1.648721, 1.1) = 1.648721,
    #        gradient -A*s = 1.648721 (GSPO has no dual clip)
    s0, s1, s2 = math.exp(0.1), math.exp(-0.1), math.exp(0.5)
    assert_close(loss, torch.tensor([[-1.1] * 3, [-2 * s1, -2 * s1, 0.0], [s2, 0.0, 0.0]]))
    assert_close(lp.grad, torch.tensor([[0.0] * 3, [-2 * s1, -2 * s1, 0.0], [s2, 0.0, 0.0]]))
    # 3 of 6 valid tokens clipped, all above 1
    assert_close(m["clip_frac"], torch.tensor(0.5))
    assert_close(m["clip_frac_high"], torch.tensor(0.5))
    assert_close(m["clip_frac_low"], torch.tensor(0.0))
    assert_close(m["seq_ratio_mean"], torch.tensor((s0 + s1 + s2) / 3))
    assert_close(m["seq_ratio_max"], torch.tensor(s2))
    # token k1 = mean(-lr) over the 6 valid tokens = -(0.3 - 0.1 + 0.1 + 0.2 - 0.4 + 0.5)/6
    assert_close(m["approx_kl"], torch.tensor(-0.6 / 6))


def test_hand_worked_paper_defaults():
    # Defaults (3e-4, 4e-4): log s = 0.001 -> s = 1.0010005 > 1.0004, A = 1: loss -1.0004, no grad.
    # log s = -0.0002 -> s = 0.9998 inside [0.9997, 1.0004], A = 1: loss -0.9998, grad -0.9998.
    old = torch.zeros(2, 1)
    lp = leaf(torch.tensor([[0.001], [-0.0002]]))
    loss, _ = gspo(lp, old, torch.ones(2, 1), torch.ones(2, 1, dtype=torch.bool))
    loss.sum().backward()
    s = math.exp(-0.0002)
    assert_close(loss, torch.tensor([[-1.0004], [-s]]))
    assert_close(lp.grad, torch.tensor([[0.0], [-s]]))


# ---------------------------------------------------------------- loop reference


def _reference(lp, old, adv, mask, clip, clamp):
    """Row by row in Python floats: loss and d loss / d logprob of each token."""
    b, t = lp.shape
    loss, grad = torch.zeros(b, t), torch.zeros(b, t)
    for i in range(b):
        valid = [j for j in range(t) if mask[i, j]]
        if not valid:
            continue
        log_s = sum(float(lp[i, j]) - float(old[i, j]) for j in valid) / len(valid)
        s = math.exp(min(max(log_s, -clamp), clamp))
        s_clipped = min(max(s, 1 - clip[0]), 1 + clip[1])
        for j in valid:
            a = float(adv[i, j])
            if -a * s_clipped > -a * s:
                loss[i, j], grad[i, j] = -a * s_clipped, 0.0
            else:  # d s_{i,t} / d logp_t = s (the sequence part is detached)
                loss[i, j], grad[i, j] = -a * s, -a * s
    return loss, grad


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("clip", "clamp"), [((3e-4, 4e-4), 10.0), ((0.01, 0.02), 0.02)])
def test_matches_loop_reference(seed, clip, clamp):
    lp, old, adv, mask = random_batch(seed, spread=SPREAD, row_advantage=True)
    lp_leaf = leaf(lp)
    loss, m = gspo(lp_leaf, old, adv, mask, clip=clip, log_ratio_clamp=clamp)
    loss.sum().backward()
    ref_loss, ref_grad = _reference(lp, old, adv, mask, clip, clamp)
    assert_close(loss, ref_loss)
    assert_close(lp_leaf.grad, ref_grad)
    has_tokens = mask.any(-1)
    seq_s = [
        math.exp(min(max(float((lp[i] - old[i])[mask[i]].mean()), -clamp), clamp))
        for i in range(lp.shape[0])
        if has_tokens[i]
    ]
    assert_close(m["seq_ratio_mean"], torch.tensor(sum(seq_s) / len(seq_s)))
    assert_close(m["seq_ratio_max"], torch.tensor(max(seq_s)))


# ---------------------------------------------------------------- limits


@pytest.mark.parametrize("seed", range(3))
def test_ratio_one_is_plain_policy_gradient(seed):
    _, old, adv, mask = random_batch(seed, spread=SPREAD, row_advantage=True)
    lp = torch.where(mask, old, NAN)
    lp_leaf = leaf(lp)
    loss, m = gspo(lp_leaf, old, adv, mask)
    _, pg_grad = policy_gradient(lp, old, adv, mask)
    loss.sum().backward()
    assert_close(loss, torch.where(mask, -adv, 0.0))  # -A*s with s = 1
    assert_close(lp_leaf.grad, pg_grad)
    assert_close(m["clip_frac"], torch.tensor(0.0))
    assert_close(m["seq_ratio_mean"], torch.tensor(1.0))


@pytest.mark.parametrize("seed", range(3))
def test_token_form_has_the_gradient_of_sequence_form(seed):
    # GSPO proper: loss_i = max(-A_i s_i, -A_i clip(s_i)) with s_i differentiable, averaged over
    # rows. GSPO-token aggregated seq-mean-token-mean must give the same gradient.
    lp, old, adv, mask = random_batch(seed, spread=SPREAD, row_advantage=True)
    clip = (0.01, 0.01)
    lp_leaf = leaf(lp)
    loss, _ = gspo(lp_leaf, old, adv, mask, clip=clip)
    rows = mask.any(-1)
    per_row = torch.where(mask, loss, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    per_row[rows].mean().backward()

    seq_leaf = leaf(lp)
    total = torch.zeros(())
    for i in rows.nonzero().flatten().tolist():
        s = torch.exp((seq_leaf[i] - old[i])[mask[i]].mean())
        a = adv[i][mask[i]][0]
        total = total + torch.maximum(-a * s, -a * s.clamp(1 - clip[0], 1 + clip[1]))
    (total / rows.sum()).backward()
    assert_close(lp_leaf.grad, torch.nan_to_num(seq_leaf.grad, nan=0.0))


def test_masked_tokens_with_inf_and_nan_give_zero_loss_and_gradient():
    lp = leaf(torch.tensor([[-1.0, -INF, NAN], [NAN, INF, -INF]]))
    old = torch.tensor([[-1.0, NAN, INF], [-INF, 0.0, NAN]])
    adv = torch.tensor([[3.0, NAN, INF], [NAN, 1.0, 1.0]])
    mask = torch.tensor([[True, False, False], [False, False, False]])
    loss, m = gspo(lp, old, adv, mask)
    loss.sum().backward()
    assert_close(loss, torch.tensor([[-3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert_close(lp.grad, torch.tensor([[-3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert all(torch.isfinite(v) for v in m.values())


def test_is_weights_and_dtypes():
    lp, old, adv, mask = random_batch(2, spread=SPREAD, row_advantage=True)
    w = torch.where(mask, 0.5, NAN)
    half, _ = gspo(lp, old, adv, mask, is_weights=w)
    full, m = gspo(lp.bfloat16(), old, adv, mask)
    full32, _ = gspo(lp.bfloat16().float(), old, adv, mask)
    assert_close(half, 0.5 * gspo(lp, old, adv, mask)[0])
    assert full.dtype == torch.float32
    assert_close(full, full32)
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in m.values())
