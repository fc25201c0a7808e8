import math
import struct

import pytest
import torch
from loss_cases import INF, NAN, leaf, policy_gradient, random_batch
from torch.testing import assert_close

from rlblocks.losses.cov import clip_cov, kl_cov
from rlblocks.losses.ppo import clipped_surrogate

# scale of log r = logp - old in the random batches
SPREAD = 0.3


def _clip_cov_grad(lp, old, adv, mask, **kw):
    lp_leaf = leaf(lp)
    loss, m = clip_cov(lp_leaf, old, adv, mask, **kw)
    loss.sum().backward()
    return loss, lp_leaf.grad, m


def _picked_by_clip_cov(lp, old, adv, mask, **kw):
    """Tokens whose gradient Clip-Cov removed (PPO would have given them one)."""
    _, grad, _ = _clip_cov_grad(lp, old, adv, mask, **kw)
    ppo_leaf = leaf(lp)
    ppo_kw = {k: v for k, v in kw.items() if k in ("clip", "dual_clip", "log_ratio_clamp")}
    clipped_surrogate(ppo_leaf, old, adv, mask, dual_clip=None, **ppo_kw)[0].sum().backward()
    return (grad == 0) & (ppo_leaf.grad != 0)


# Four on-policy tokens (ratio 1, so the PPO clip is inactive):
#   A    = [3, -1, -1, -1]            mean A = 0
#   logp = [-0.5, -1.5, -2.5, -3.5]  mean logp = -2, centred [1.5, 0.5, -0.5, -1.5]
#   cov  = [3*1.5, -1*0.5, -1*-0.5, -1*-1.5] = [4.5, -0.5, 0.5, 1.5]
_ADV = torch.tensor([[3.0, -1.0, -1.0, -1.0, NAN]])
_LP = torch.tensor([[-0.5, -1.5, -2.5, -3.5, NAN]])
_MASK = torch.tensor([[True, True, True, True, False]])


# ---------------------------------------------------------------- Clip-Cov: hand-worked


def test_clip_cov_hand_worked_detaches_all_eligible():
    # bounds [1, 5]: tokens 0 (4.5) and 3 (1.5) are eligible; clip_ratio 0.5 -> floor(0.5*4) = 2
    # tokens picked = both. Values stay -A*r = -A = [-3, 1, 1, 1]; gradients -A on tokens 1, 2.
    loss, grad, m = _clip_cov_grad(_LP, _LP, _ADV, _MASK, clip_ratio=0.5)
    assert_close(loss, torch.tensor([[-3.0, 1.0, 1.0, 1.0, 0.0]]))
    assert_close(grad, torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0]]))
    assert_close(m["clip_cov_frac"], torch.tensor(0.5))  # 2 of 4


def test_clip_cov_hand_worked_picks_one_of_two():
    # clip_ratio 0.25 -> floor(0.25*4) = 1 token of {0, 3}, whichever the seed picks.
    for seed in range(4):
        picked = _picked_by_clip_cov(_LP, _LP, _ADV, _MASK, clip_ratio=0.25, seed=seed)
        assert picked.sum() == 1
        assert bool(picked[0, 0] | picked[0, 3])


def test_clip_cov_hand_worked_narrow_bounds():
    # bounds [1, 2]: only token 3 (cov 1.5) is eligible; default clip_ratio 2e-4 -> max(0, 1) = 1.
    for seed in range(4):
        picked = _picked_by_clip_cov(_LP, _LP, _ADV, _MASK, cov_bounds=(1.0, 2.0), seed=seed)
        assert picked.tolist() == [[False, False, False, True, False]]


def test_clip_cov_skips_tokens_already_clipped_by_ppo():
    # Token 0 now has ratio e^0.5 = 1.65 > 1.2 with A = 3 > 0: PPO clips it, so only token 3 is
    # eligible. The cov uses the current logp: shifting old leaves cov unchanged.
    old = _LP.clone()
    old[0, 0] = -1.0
    loss, grad, m = _clip_cov_grad(_LP, old, _ADV, _MASK, clip_ratio=0.5)
    # token 0: -A*1.2 = -3.6 (clipped, no grad); token 3 detached; tokens 1, 2 grad -A = 1
    assert_close(loss, torch.tensor([[-3.6, 1.0, 1.0, 1.0, 0.0]]))
    assert_close(grad, torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0]]))
    assert_close(m["clip_cov_frac"], torch.tensor(0.25))
    assert_close(m["clip_frac"], torch.tensor(0.25))


# ---------------------------------------------------------------- KL-Cov: hand-worked


def test_kl_cov_hand_worked():
    # log r = logp - old = [0.1, 0.2, -0.1, 0.3]; cov (from logp) = [4.5, -0.5, 0.5, 1.5]
    old = _LP - torch.tensor([[0.1, 0.2, -0.1, 0.3, 0.0]])
    r = [math.exp(x) for x in (0.1, 0.2, -0.1, 0.3)]
    # k_fraction 0.25 -> 1 token: the top cov, token 0.
    #   token 0: -3*e^0.1 + |0.1| = -3.315513 + 0.1 = -3.215513; grad -3*e^0.1 + 1 = -2.315513
    #   others:  -A*r = r;  grad -A*r = r
    lp = leaf(_LP)
    loss, m = kl_cov(lp, old, _ADV, _MASK, k_fraction=0.25)
    loss.sum().backward()
    assert_close(loss, torch.tensor([[-3 * r[0] + 0.1, r[1], r[2], r[3], 0.0]]))
    assert_close(lp.grad, torch.tensor([[-3 * r[0] + 1, r[1], r[2], r[3], 0.0]]))
    assert_close(m["kl_cov_frac"], torch.tensor(0.25))
    assert_close(m["abs_kl"], torch.tensor(0.7 / 4))  # (0.1 + 0.2 + 0.1 + 0.3)/4
    # k_fraction 0.5 -> tokens 0 and 3 (cov 4.5, 1.5):
    #   token 3: e^0.3 + 0.3 = 1.649859; grad e^0.3 + 1 = 2.349859
    lp = leaf(_LP)
    loss, _ = kl_cov(lp, old, _ADV, _MASK, k_fraction=0.5, kl_coef=1.0)
    loss.sum().backward()
    assert_close(loss, torch.tensor([[-3 * r[0] + 0.1, r[1], r[2], r[3] + 0.3, 0.0]]))
    assert_close(lp.grad, torch.tensor([[-3 * r[0] + 1, r[1], r[2], r[3] + 1, 0.0]]))


def test_kl_cov_ties_broken_by_position():
    # A = [1, 1, -1, -1] (mean 0), logp = [0, 0, -2, -2] (mean -1): cov = [1, 1, 1, 1] in every
    # row; with 8 valid tokens and k_fraction 0.25 -> 2 picked: the first two in row-major order.
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]] * 2)
    lp = torch.tensor([[0.0, 0.0, -2.0, -2.0]] * 2)
    mask = torch.ones(2, 4, dtype=torch.bool)
    loss, _ = kl_cov(lp, lp - 0.5, adv, mask, k_fraction=0.25)
    no_penalty, _ = kl_cov(lp, lp - 0.5, adv, mask, k_fraction=0.25, kl_coef=0.0)
    assert_close(loss - no_penalty, torch.tensor([[0.5, 0.5, 0, 0], [0, 0, 0, 0]]))


# ---------------------------------------------------------------- loop references

_M32 = 0xFFFFFFFF


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x45D9F3B) & _M32
    x ^= x >> 16
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def _key(seed: int, position: int, old: float) -> int:
    """The documented selection hash of (seed, flat position, float32 bits of old_logprobs)."""
    bits = struct.unpack("<I", struct.pack("<f", old))[0]
    return _mix(_mix(_mix(position) ^ _mix((seed ^ (seed >> 32)) & _M32)) ^ bits)


def _valid(mask):
    return [tuple(ij) for ij in mask.nonzero().tolist()]


def _cov(lp, adv, mask):
    cells = _valid(mask)
    mean_a = sum(float(adv[c]) for c in cells) / len(cells)
    mean_lp = sum(float(lp[c]) for c in cells) / len(cells)
    return {c: (float(adv[c]) - mean_a) * (float(lp[c]) - mean_lp) for c in cells}


def _reference_clip_cov(lp, old, adv, mask, *, clip, clip_ratio, cov_bounds, seed):
    loss, grad = torch.zeros(lp.shape), torch.zeros(lp.shape)
    cov, eligible = _cov(lp, adv, mask), []
    for i, j in _valid(mask):
        a, r = float(adv[i, j]), math.exp(float(lp[i, j]) - float(old[i, j]))
        rc = min(max(r, 1 - clip[0]), 1 + clip[1])
        if -a * rc > -a * r:
            loss[i, j], grad[i, j] = -a * rc, 0.0
        else:
            loss[i, j], grad[i, j] = -a * r, -a * r
            if cov_bounds[0] <= cov[i, j] <= cov_bounds[1]:
                eligible.append((i, j))
    n_pick = max(int(clip_ratio * len(cov)), 1)
    width = lp.shape[1]
    eligible.sort(key=lambda c: (_key(seed, c[0] * width + c[1], float(old[c])), c))
    for c in eligible[:n_pick]:
        grad[c] = 0.0
    return loss, grad, len(eligible[:n_pick])


def _reference_kl_cov(lp, old, adv, mask, *, k_fraction, kl_coef):
    loss, grad = torch.zeros(lp.shape), torch.zeros(lp.shape)
    cov = _cov(lp, adv, mask)
    top = sorted(cov, key=lambda c: (-cov[c], c))[: max(int(k_fraction * len(cov)), 1)]
    for c in _valid(mask):
        a, x = float(adv[c]), float(lp[c]) - float(old[c])
        loss[c], grad[c] = -a * math.exp(x), -a * math.exp(x)
        if c in top:
            loss[c] += kl_coef * abs(x)
            grad[c] += kl_coef * math.copysign(1.0, x)
    return loss, grad


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("clip_ratio", "cov_bounds"), [(2e-4, (1.0, 5.0)), (0.2, (0.05, 2.0)), (1.0, (-9.0, 9.0))]
)
def test_clip_cov_matches_loop_reference(seed, clip_ratio, cov_bounds):
    lp, old, adv, mask = random_batch(seed, spread=SPREAD)
    kw = {"clip": (0.2, 0.28), "clip_ratio": clip_ratio, "cov_bounds": cov_bounds, "seed": seed}
    loss, grad, m = _clip_cov_grad(lp, old, adv, mask, **kw)
    ref_loss, ref_grad, n_picked = _reference_clip_cov(lp, old, adv, mask, **kw)
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    assert_close(m["clip_cov_frac"], torch.tensor(n_picked / int(mask.sum())))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("k_fraction", "kl_coef"), [(2e-4, 1.0), (0.3, 0.5)])
def test_kl_cov_matches_loop_reference(seed, k_fraction, kl_coef):
    lp, old, adv, mask = random_batch(seed, spread=SPREAD)
    lp_leaf = leaf(lp)
    loss, m = kl_cov(lp_leaf, old, adv, mask, k_fraction=k_fraction, kl_coef=kl_coef)
    loss.sum().backward()
    ref_loss, ref_grad = _reference_kl_cov(
        lp, old, adv, mask, k_fraction=k_fraction, kl_coef=kl_coef
    )
    assert_close(loss, ref_loss)
    assert_close(lp_leaf.grad, ref_grad)
    n_valid = int(mask.sum())
    assert_close(m["kl_cov_frac"], torch.tensor(max(int(k_fraction * n_valid), 1) / n_valid))


# ---------------------------------------------------------------- determinism of the pick


def test_clip_cov_same_seed_same_pick_regardless_of_global_rng():
    lp, old, adv, mask = random_batch(7, spread=SPREAD)
    kw = {"clip_ratio": 0.3, "cov_bounds": (-9.0, 9.0), "seed": 123}
    torch.manual_seed(0)
    first = _picked_by_clip_cov(lp, old, adv, mask, **kw)
    torch.manual_seed(999)
    torch.rand(100)
    second = _picked_by_clip_cov(lp.clone(), old.clone(), adv.clone(), mask.clone(), **kw)
    assert first.any()
    assert torch.equal(first, second)


def test_clip_cov_different_seed_can_give_different_pick():
    lp, old, adv, mask = random_batch(7, spread=SPREAD)
    kw = {"clip_ratio": 0.3, "cov_bounds": (-9.0, 9.0)}
    picks = [_picked_by_clip_cov(lp, old, adv, mask, seed=s, **kw) for s in range(4)]
    # the number picked is fixed by clip_ratio, but which tokens are picked changes with seed
    assert len({int(p.sum()) for p in picks}) == 1
    assert any(not torch.equal(picks[0], p) for p in picks[1:])


# ---------------------------------------------------------------- limits


@pytest.mark.parametrize("seed", range(3))
def test_ratio_one_is_plain_policy_gradient(seed):
    _, old, adv, mask = random_batch(seed, spread=SPREAD)
    lp = torch.where(mask, old, NAN)
    _, pg_grad = policy_gradient(lp, old, adv, mask)
    # KL-Cov: |log r| = 0 has value 0 and (sub)gradient 0, whatever tokens are selected
    lp_leaf = leaf(lp)
    loss, m = kl_cov(lp_leaf, old, adv, mask, k_fraction=0.5)
    loss.sum().backward()
    assert_close(loss, torch.where(mask, -adv, 0.0))
    assert_close(lp_leaf.grad, pg_grad)
    assert_close(m["abs_kl"], torch.tensor(0.0))
    # Clip-Cov with no token in the covariance window is PPO, hence the plain gradient
    loss, grad, m = _clip_cov_grad(lp, old, adv, mask, cov_bounds=(1e9, 2e9))
    assert_close(loss, torch.where(mask, -adv, 0.0))
    assert_close(grad, pg_grad)
    assert_close(m["clip_cov_frac"], torch.tensor(0.0))
    assert_close(m["clip_frac"], torch.tensor(0.0))


def test_single_valid_token():
    # One valid token: cov = 0. Clip-Cov (bounds [1, 5]) picks nothing, so the token keeps the
    # unclipped PPO gradient -A*r = -2*e^0.5 (clip (0.2, 1.0) admits r = e^0.5 = 1.65).
    # KL-Cov picks it (at least one token).
    lp = torch.tensor([[-1.0, NAN]])
    old = torch.tensor([[-1.5, -INF]])
    adv = torch.tensor([[2.0, NAN]])
    mask = torch.tensor([[True, False]])
    _, grad, m = _clip_cov_grad(lp, old, adv, mask, clip=(0.2, 1.0))
    assert_close(grad, torch.tensor([[-2 * math.exp(0.5), 0.0]]))
    assert_close(m["clip_cov_frac"], torch.tensor(0.0))
    _, m = kl_cov(lp, old, adv, mask)
    assert_close(m["kl_cov_frac"], torch.tensor(1.0))


@pytest.mark.parametrize("fn", [clip_cov, kl_cov])
def test_masked_tokens_with_inf_and_nan_give_zero_loss_and_gradient(fn):
    lp = leaf(torch.tensor([[-1.0, -2.0, -INF, NAN], [NAN, INF, -INF, NAN]]))
    old = torch.tensor([[-1.0, -2.5, NAN, -INF], [INF, NAN, 0.0, -INF]])
    adv = torch.tensor([[1.0, -1.0, NAN, INF], [NAN, 1.0, INF, NAN]])
    mask = torch.tensor([[True, True, False, False], [False, False, False, False]])
    loss, m = fn(lp, old, adv, mask)
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all() and torch.isfinite(loss).all()
    assert_close(loss[~mask], torch.zeros(6))
    assert_close(lp.grad[~mask], torch.zeros(6))
    assert all(torch.isfinite(v) and v.dtype == torch.float32 for v in m.values())


def test_no_valid_token():
    lp = leaf(torch.full((2, 3), NAN))
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for fn in (clip_cov, kl_cov):
        loss, m = fn(lp, torch.zeros(2, 3), torch.ones(2, 3), mask)
        assert_close(loss, torch.zeros(2, 3))
        assert all(v == 0 for v in m.values())


@pytest.mark.parametrize("loss_fn", [clip_cov, kl_cov])
def test_log_ratio_clamped_at_20_unlike_verl(loss_fn):
    # Token 0 has log r = -1 - (-26) = 25, token 1 is on-policy. A = -1 for both: centred A is 0,
    # so cov = 0 (nothing picked by Clip-Cov's [1, 5] band) and, with kl_coef 0, KL-Cov is -A*r.
    # For A < 0 the PPO clip keeps max(r, clip(r)) = r: loss_t = r_t, d loss_t / d logp_t = r_t.
    lp, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-26.0, -2.0]])
    adv, mask = torch.tensor([[-1.0, -1.0]]), torch.tensor([[True, True]])
    kw = {"kl_coef": 0.0} if loss_fn is kl_cov else {}
    for clamp, ratio, grad in [(20.0, math.exp(20), 0.0), (INF, math.exp(25), math.exp(25))]:
        # 20 (the default): r = e^20 and no gradient through it; inf: verl's exp(25), unclamped.
        lp_leaf = leaf(lp)
        loss, _ = loss_fn(lp_leaf, old, adv, mask, log_ratio_clamp=clamp, **kw)
        loss.sum().backward()
        assert_close(loss, torch.tensor([[ratio, 1.0]]))
        assert_close(lp_leaf.grad, torch.tensor([[grad, 1.0]]))
