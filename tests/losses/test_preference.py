import math

import pytest
import torch
from torch.testing import assert_close

from rlblocks.losses import (
    aggregate,
    clipped_surrogate,
    dpo,
    ipo,
    preference_advantages,
    preference_loss,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    simpo,
    token_mean,
)

NAN, INF = float("nan"), float("inf")
LOSSES = [dpo, ipo, simpo]


def _rows(logprobs, ref, t=4, dtype=torch.float64):
    """Left-aligned rows padded to ``t`` with garbage (NaN log-probs, −inf ref) behind the mask."""
    lp = torch.full((len(logprobs), t), NAN, dtype=dtype)
    rf = torch.full((len(logprobs), t), -INF, dtype=dtype)
    mask = torch.zeros(len(logprobs), t, dtype=torch.bool)
    for i, (row, ref_row) in enumerate(zip(logprobs, ref, strict=True)):
        lp[i, : len(row)] = torch.tensor(row, dtype=dtype)
        rf[i, : len(row)] = torch.tensor(ref_row, dtype=dtype)
        mask[i, : len(row)] = True
    return lp, rf, mask


def _pairs(*pairs):
    chosen, rejected = zip(*pairs, strict=True)
    return torch.tensor(chosen), torch.tensor(rejected)


def _random_batch(seed, b=7, t=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(b, t, generator=g) * 3).to(dtype)
    ref = (-torch.rand(b, t, generator=g) * 3).to(dtype)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[:, 0] = True  # every row has a token ...
    mask[3, 1:] = False  # ... one has exactly one
    mask[5, 2] = False  # a hole, as left by tool observation tokens
    # row 6 is in no pair; row 0 is chosen twice, row 1 both chosen and rejected (other pairs)
    chosen, rejected = _pairs((0, 1), (0, 2), (1, 3), (4, 5), (5, 2))
    return logprobs, ref, mask, chosen, rejected


# ---------------------------------------------------------------- hand-worked


def test_dpo_hand_worked():
    # row 0 (chosen):   Σ logπ = −1 − 2 = −3,       Σ logπ_ref = −1.5 − 2.5 = −4    -> s = 1
    # row 1 (rejected): Σ logπ = −2 − 2 − 1 = −5,   Σ logπ_ref = 3 · −1.5 = −4.5    -> s = −0.5
    # h = 1 − (−0.5) = 1.5, β = 0.5: βh = 0.75
    # L = −log σ(0.75) = log(1 + e^−0.75) = log(1 + 0.4723665527410147) = 0.38687100611489994
    lp, ref, mask = _rows([[-1, -2], [-2, -2, -1]], [[-1.5, -2.5], [-1.5, -1.5, -1.5]])
    loss, metrics = dpo(lp, ref, mask, *_pairs((0, 1)), beta=0.5)
    assert loss.shape == (1,) and loss.dtype == torch.float64
    assert_close(loss, torch.tensor([0.38687100611489994], dtype=torch.float64))
    assert_close(loss, torch.tensor([math.log1p(math.exp(-0.75))], dtype=torch.float64))
    # rewards β·s: 0.5 · 1 = 0.5 and 0.5 · −0.5 = −0.25
    expected = {"loss": 0.38687100611489994, "margin": 1.5, "accuracy": 1.0}
    expected |= {"chosen_reward": 0.5, "rejected_reward": -0.25}
    assert_close(metrics, {f"preference/{k}": torch.tensor(v) for k, v in expected.items()})


def test_ipo_hand_worked():
    # row 0 (chosen):   log-ratios −1 − (−1.5) = 0.5, −2 − (−2.5) = 0.5   mean 0.5,   sum 1
    # row 1 (rejected): log-ratios −1, −1, 0                               mean −2/3,  sum −2
    # β = 0.5: target 1/(2β) = 1
    # length-normalized (ipo's default): h = 0.5 + 2/3 = 7/6, L = (7/6 − 1)² = 1/36
    # summed (eq. 17 literally):         h = 1 + 2 = 3,       L = (3 − 1)² = 4
    lp, ref, mask = _rows([[-1, -2], [-2, -3, -1]], [[-1.5, -2.5], [-1, -2, -1]])
    pairs = _pairs((0, 1))
    loss, metrics = ipo(lp, ref, mask, *pairs, beta=0.5)
    assert_close(loss, torch.tensor([1 / 36], dtype=torch.float64))
    assert_close(metrics["preference/margin"], torch.tensor(7 / 6))
    loss, _ = ipo(lp, ref, mask, *pairs, beta=0.5, length_normalized=False)
    assert_close(loss, torch.tensor([4.0], dtype=torch.float64))


def test_simpo_hand_worked():
    # no reference, mean log-probs: row 0 (−0.5 − 1.5)/2 = −1, row 1 (−2 − 3 − 4)/3 = −3
    # h = −1 − (−3) = 2; β = 2, γ = 1 (simpo's defaults): βh − γ = 3
    # L = log(1 + e^−3) = log(1 + 0.049787068367863944) = 0.04858735157374206
    lp, _, mask = _rows([[-0.5, -1.5], [-2, -3, -4]], [[0, 0], [0, 0, 0]])
    loss, metrics = simpo(lp, None, mask, *_pairs((0, 1)))
    assert_close(loss, torch.tensor([0.04858735157374206], dtype=torch.float64))
    # rewards β·s: 2 · −1 = −2 and 2 · −3 = −6 (SimPO's reference-free implicit reward)
    assert_close(metrics["preference/chosen_reward"], torch.tensor(-2.0))
    assert_close(metrics["preference/rejected_reward"], torch.tensor(-6.0))
    # a reference passed anyway is ignored
    garbage_ref = torch.full_like(lp, 123.0)
    assert_close(simpo(lp, garbage_ref, mask, *_pairs((0, 1)))[0], loss)


def test_metrics_hand_worked_over_several_pairs():
    # one token per row, no reference, β = 1: s = (−1, −2, −3, −0.5, −2)
    # pairs (0,1): h = 1;  (2,3): h = −2.5 (wrong);  (0,2): h = 2 (row 0 again);  (1,4): h = 0 (a tie)
    lp = torch.tensor([[-1.0], [-2.0], [-3.0], [-0.5], [-2.0]], dtype=torch.float64)
    mask = torch.ones(5, 1, dtype=torch.bool)
    pairs = _pairs((0, 1), (2, 3), (0, 2), (1, 4))
    loss, metrics = dpo(lp, None, mask, *pairs, beta=1.0, reference=False)
    per_pair = [
        math.log1p(math.exp(-h)) for h in (1.0, -2.5, 2.0, 0.0)
    ]  # −log σ(h); log 2 for h = 0
    assert_close(loss, torch.tensor(per_pair, dtype=torch.float64))
    expected = {
        "loss": sum(per_pair) / 4,
        "margin": (1.0 - 2.5 + 2.0 + 0.0) / 4,  # 0.125
        "accuracy": 2 / 4,  # h > 0 strictly: the tie does not count
        "chosen_reward": (-1.0 - 3.0 - 1.0 - 2.0) / 4,  # rows 0, 2, 0, 1
        "rejected_reward": (-2.0 - 0.5 - 3.0 - 2.0) / 4,  # rows 1, 3, 2, 4
    }
    assert_close(metrics, {f"preference/{k}": torch.tensor(v) for k, v in expected.items()})
    assert all(m.dtype == torch.float32 and not m.requires_grad for m in metrics.values())


def test_row_without_tokens_scores_zero_when_length_normalized():
    # row 1 has no valid token: |y| = 0 is clamped to 1 (as TRL does), so s_1 = 0, not NaN.
    # IPO, β = 0.5: row 0 s = mean(−1 − (−2)) = 1, h = 1 − 0 = 1, L = (1 − 1)² = 0
    lp, ref, mask = _rows([[-1.0], []], [[-2.0], []])
    lp.requires_grad_(True)
    loss, _ = ipo(lp, ref, mask, *_pairs((0, 1)), beta=0.5)
    assert_close(loss, torch.zeros(1, dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert torch.isfinite(grad).all()


# ---------------------------------------------------------------- loop reference


def _loop_loss(lp, ref, mask, chosen, rejected, beta, link, margin, normalized, reference):
    scores = []
    for i in range(lp.shape[0]):
        total, count = 0.0, 0
        for t in range(lp.shape[1]):
            if mask[i, t]:
                total += float(lp[i, t]) - (float(ref[i, t]) if reference else 0.0)
                count += 1
        scores.append(total / max(count, 1) if normalized else total)
    losses = []
    for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True):
        h = scores[c] - scores[r]
        if link == "sigmoid":
            z = beta * h - margin
            losses.append(math.log1p(math.exp(-z)))  # −log σ(z), |z| is small here
        else:
            losses.append((h - 1 / (2 * beta)) ** 2)
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("link,margin", [("sigmoid", 0.0), ("sigmoid", 0.7), ("squared", 0.0)])
@pytest.mark.parametrize("normalized", [False, True])
@pytest.mark.parametrize("reference", [False, True])
def test_matches_loop(seed, link, margin, normalized, reference):
    lp, ref, mask, chosen, rejected = _random_batch(seed)
    kw = {"beta": 0.3, "link": link, "margin": margin, "length_normalized": normalized}
    loss, _ = preference_loss(lp, ref, mask, chosen, rejected, reference=reference, **kw)
    expected = _loop_loss(lp, ref, mask, chosen, rejected, 0.3, link, margin, normalized, reference)
    assert_close(loss, expected)


# ---------------------------------------------------------------- masks, dtypes, variants


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_masked_positions_change_nothing(loss_fn):
    lp, ref, mask, chosen, rejected = _random_batch(0)
    clean_lp = lp.clone().requires_grad_(True)
    dirty = lp.clone()
    dirty[~mask] = torch.tensor([NAN, INF, -INF, 1e30], dtype=dirty.dtype).repeat(100)[
        : int((~mask).sum())
    ]
    dirty_lp = dirty.requires_grad_(True)
    dirty_ref = ref.clone()
    dirty_ref[~mask] = NAN
    clean_loss, clean_metrics = loss_fn(clean_lp, ref, mask, chosen, rejected)
    dirty_loss, dirty_metrics = loss_fn(dirty_lp, dirty_ref, mask, chosen, rejected)
    assert_close(dirty_loss, clean_loss)
    assert_close(dirty_metrics, clean_metrics)
    (clean_grad,) = torch.autograd.grad(clean_loss.sum(), clean_lp)
    (dirty_grad,) = torch.autograd.grad(dirty_loss.sum(), dirty_lp)
    assert_close(dirty_grad, clean_grad)
    assert (dirty_grad[~mask] == 0).all()


def test_float32_output_for_low_precision_inputs():
    lp, ref, mask, chosen, rejected = _random_batch(0, dtype=torch.bfloat16)
    for loss_fn in LOSSES:
        loss, metrics = loss_fn(lp, ref, mask, chosen, rejected)
        assert loss.dtype == torch.float32
        assert all(m.dtype == torch.float32 for m in metrics.values())


@pytest.mark.parametrize(
    "variant,keywords",
    [
        (
            dpo,
            {
                "link": "sigmoid",
                "beta": 0.1,
                "margin": 0.0,
                "length_normalized": False,
                "reference": True,
            },
        ),
        (ipo, {"link": "squared", "beta": 0.1, "length_normalized": True, "reference": True}),
        (
            simpo,
            {
                "link": "sigmoid",
                "beta": 2.0,
                "margin": 1.0,
                "length_normalized": True,
                "reference": False,
            },
        ),
    ],
)
def test_variants_are_preference_loss_with_fixed_keywords(variant, keywords):
    lp, ref, mask, chosen, rejected = _random_batch(1)
    assert_close(
        variant(lp, ref, mask, chosen, rejected),
        preference_loss(lp, ref, mask, chosen, rejected, **keywords),
    )
    # overriding a keyword passes it through, as with a partial
    keywords = keywords | {"beta": 0.7, "length_normalized": not keywords["length_normalized"]}
    overrides = {k: v for k, v in keywords.items() if k != "link"}
    assert_close(
        variant(lp, ref, mask, chosen, rejected, **overrides),
        preference_loss(lp, ref, mask, chosen, rejected, **keywords),
    )


def test_no_pairs():
    lp, ref, mask, _, _ = _random_batch(0)
    empty = torch.zeros(0, dtype=torch.int64)
    loss, metrics = dpo(lp, ref, mask, empty, empty)
    assert loss.shape == (0,)
    assert all(m == 0 for m in metrics.values())
    advantages, _ = preference_advantages(dpo, lp, ref, mask, empty, empty)
    assert (advantages == 0).all()


# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_advantages_match_closed_form_dpo_gradient(scale):
    # ∂L_p/∂logπ_it = −β σ(−βh_p) · (+1 on every valid token of chosen[p], −1 of rejected[p]),
    # so A_it = scale · Σ_p β σ(−βh_p) · ([i = chosen[p]] − [i = rejected[p]]).
    lp, ref, mask, chosen, rejected = _random_batch(2)
    beta = 0.4
    advantages, metrics = preference_advantages(
        lambda *a: dpo(*a, beta=beta), lp, ref, mask, chosen, rejected, scale=scale
    )
    seq = torch.where(mask, lp - ref, 0.0).sum(-1)
    expected = torch.zeros(lp.shape[0], dtype=torch.float64)
    for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True):
        weight = beta * torch.sigmoid(-beta * (seq[c] - seq[r]))
        expected[c] += scale * weight
        expected[r] -= scale * weight
    expected = torch.where(mask, expected[:, None], 0.0).float()
    assert advantages.dtype == torch.float32
    assert_close(advantages, expected)
    assert (advantages[6] == 0).all()  # row 6 is in no pair
    assert (advantages[~mask] == 0).all()
    assert_close(metrics, dpo(lp, ref, mask, chosen, rejected, beta=beta)[1])


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_advantages_match_finite_differences(loss_fn):
    # Central differences of Σ_p L_p in float64 with ε = 1e-6: truncation ε²/6·|L'''| ~ 1e-13
    # and rounding ~ 1e-16·|Σ L| / ε ~ 1e-9, far below the float32 tolerance of A.
    lp, ref, mask, chosen, rejected = _random_batch(3)
    scale, eps = 1.7, 1e-6
    advantages, _ = preference_advantages(loss_fn, lp, ref, mask, chosen, rejected, scale=scale)
    expected = torch.zeros_like(lp)
    for i, t in mask.nonzero().tolist():
        up, down = lp.clone(), lp.clone()
        up[i, t] += eps
        down[i, t] -= eps
        diff = loss_fn(up, ref, mask, chosen, rejected)[0].sum()
        diff = diff - loss_fn(down, ref, mask, chosen, rejected)[0].sum()
        expected[i, t] = -scale * diff / (2 * eps)
    assert_close(advantages, expected.float())
    assert (advantages[~mask] == 0).all()


def test_advantages_are_detached_and_work_under_no_grad():
    lp, ref, mask, chosen, rejected = _random_batch(0, dtype=torch.float32)
    lp.requires_grad_(True)
    with torch.no_grad():
        advantages, _ = preference_advantages(dpo, lp, ref, mask, chosen, rejected)
    assert not advantages.requires_grad and lp.grad is None
    assert advantages.abs().sum() > 0


def _linear_policy(seed, b=6, t=5, d=3, v=7):
    """logπ(y_t) = log softmax(θ x_t)[y_t] for fixed features x and tokens y: a tiny policy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, d, generator=g)
    y = torch.randint(v, (b, t), generator=g)
    theta = torch.randn(v, d, generator=g).requires_grad_(True)
    ref = -torch.rand(b, t, generator=g) * 3
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[:, 0] = True
    logprobs = torch.log_softmax(x @ theta.T, dim=-1).gather(-1, y[..., None])[..., 0]
    chosen, rejected = _pairs((0, 1), (2, 3), (0, 4))  # row 5 in no pair
    return theta, logprobs, ref, mask, chosen, rejected


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_policy_gradient_step_follows_the_pair_loss(loss_fn):
    # Σ_t −A_t·logπ_t with A from scale = 1 has the gradient of Σ_p L_p at θ (chain rule).
    theta, logprobs, ref, mask, chosen, rejected = _linear_policy(0)
    (direct,) = torch.autograd.grad(
        loss_fn(logprobs, ref, mask, chosen, rejected)[0].sum(), theta, retain_graph=True
    )
    advantages, _ = preference_advantages(loss_fn, logprobs, ref, mask, chosen, rejected)
    surrogate = torch.where(mask, -advantages * logprobs, 0.0).sum()
    (bridged,) = torch.autograd.grad(surrogate, theta)
    assert_close(bridged, direct)


@pytest.mark.parametrize("loss_fn", LOSSES)
@pytest.mark.parametrize("mode", [token_mean, seq_mean_token_sum, seq_mean_token_sum_norm])
def test_trainer_path_gives_the_mean_pair_loss_gradient(loss_fn, mode):
    # What PolicyTrainer.step does at θ_old: PPO clipped surrogate (ratio 1), aggregated per
    # micro-batch with the mini-batch normalizer n; with scale = n / P the summed gradient is
    # ∇ of the mean pair loss, for any split into micro-batches.
    theta, logprobs, ref, mask, chosen, rejected = _linear_policy(1)
    (direct,) = torch.autograd.grad(
        loss_fn(logprobs, ref, mask, chosen, rejected)[0].mean(), theta, retain_graph=True
    )
    n = mode.normalizer(mask)
    advantages, _ = preference_advantages(
        loss_fn, logprobs, ref, mask, chosen, rejected, scale=float(n) / len(chosen)
    )
    per_token, _ = clipped_surrogate(logprobs, logprobs.detach(), advantages, mask)
    bridged = torch.zeros_like(theta)
    for rows in (slice(0, 2), slice(2, 6)):  # two micro-batches that split pair (0, 4)
        loss = aggregate(per_token[rows], mask[rows], mode=mode, normalizer=n)
        bridged += torch.autograd.grad(loss, theta, retain_graph=True)[0]
    assert_close(bridged, direct)


def test_trainer_path_with_seq_mean_token_mean_reweights_pairs():
    # Negative control for the module docstring's caveat: dividing each row by its own length
    # changes the gradient (rows have different lengths here).
    theta, logprobs, ref, mask, chosen, rejected = _linear_policy(1)
    assert len(set(mask.sum(-1).tolist())) > 1
    (direct,) = torch.autograd.grad(
        dpo(logprobs, ref, mask, chosen, rejected)[0].mean(), theta, retain_graph=True
    )
    n = seq_mean_token_mean.normalizer(mask)
    advantages, _ = preference_advantages(
        dpo, logprobs, ref, mask, chosen, rejected, scale=float(n) / len(chosen)
    )
    per_token, _ = clipped_surrogate(logprobs, logprobs.detach(), advantages, mask)
    loss = aggregate(per_token, mask, mode=seq_mean_token_mean, normalizer=n)
    (bridged,) = torch.autograd.grad(loss, theta)
    assert not torch.allclose(bridged, direct, rtol=1e-2, atol=1e-4)


# ---------------------------------------------------------------- errors


def _error_cases():
    lp, ref, mask, _, _ = _random_batch(0)
    c, r = _pairs((0, 1), (2, 3))
    return [
        ((lp, ref, mask, c, r[:1]), {}, ValueError, "2 chosen vs 1 rejected"),
        ((lp, ref, mask, c, torch.tensor([1, 2])), {}, ValueError, "pair 1: row 2 is both"),
        ((lp, None, mask, c, r), {}, ValueError, "ref_logprobs is None but reference=True"),
        ((lp, ref, mask, c, r), {"beta": 0.0}, ValueError, "beta must be > 0, got 0.0"),
        ((lp, ref, mask, c, r), {"beta": -1.0}, ValueError, "beta must be > 0"),
        ((lp, ref, mask, c, torch.tensor([1, 7])), {}, ValueError, r"rejected\[1\] = 7"),
        ((lp, ref, mask, torch.tensor([-1, 2]), r), {}, ValueError, r"chosen\[0\] = -1"),
        ((lp, ref, mask, c.float(), r), {}, ValueError, "1-D integer tensor"),
        ((lp, ref, mask.long(), c, r), {}, TypeError, "mask must be bool"),
        ((lp, ref[:, :2], mask, c, r), {}, ValueError, "ref_logprobs has shape"),
        ((lp, ref, mask, c, r), {"link": "hinge"}, ValueError, "link must be"),
        ((lp, ref, mask, c, r), {"link": "squared", "margin": 0.5}, ValueError, "margin applies"),
    ]


@pytest.mark.parametrize("args,kwargs,error,message", _error_cases())
def test_errors(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        preference_loss(*args, **kwargs)


def test_advantages_raise_the_loss_errors():
    lp, ref, mask, _, _ = _random_batch(0)
    with pytest.raises(ValueError, match="both chosen and rejected"):
        preference_advantages(dpo, lp, ref, mask, torch.tensor([3]), torch.tensor([3]))


def test_uses_reference_reads_the_default_a_partial_may_override():
    from functools import partial as bind

    from rlblocks.losses import uses_reference

    assert uses_reference(dpo) and uses_reference(ipo) and not uses_reference(simpo)
    assert not uses_reference(bind(dpo, reference=False))
    assert uses_reference(bind(preference_loss, beta=0.5))
