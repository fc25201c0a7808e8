import math
from functools import partial

import pytest
import torch
from torch.testing import assert_close

from rlblocks.losses.inputs import loss_inputs
from rlblocks.losses.kl import (
    AdaptiveKLController,
    FixedKLController,
    k1,
    k2,
    k3,
    kl_abs,
    kl_loss,
    kl_penalty_rewards,
    kl_regularized,
    low_var_kl,
)
from rlblocks.losses.ppo import clipped_surrogate

ESTIMATORS = [k1, k2, k3, kl_abs, low_var_kl]
LN2 = math.log(2.0)


def _random_batch(seed: int, b: int = 5, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=g) * 3
    ref_logprobs = -torch.rand(b, t, generator=g) * 3
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0] = False  # a row with no valid token
    mask[1] = False
    mask[1, 3] = True  # a row with exactly one valid token
    mask[2, :] = True
    mask[2, 2] = False  # a hole, as left by tool observation tokens
    return logprobs, ref_logprobs, mask


# ---------------------------------------------------------------- estimators: hand-worked


def test_estimators_hand_worked():
    # token 0: π_θ = 0.5, π_ref = 0.25 -> log r = log(0.25/0.5) = −ln 2, r = 0.5
    # token 1: π_θ = 0.25, π_ref = 0.5 -> log r = +ln 2, r = 2
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    # k1 = −log r
    assert_close(k1(logprobs, ref), torch.tensor([[LN2, -LN2]]))
    # k2 = ½ (log r)² = ½ ln²2 for both
    assert_close(k2(logprobs, ref), torch.tensor([[0.5 * LN2**2, 0.5 * LN2**2]]))
    # k3 = (r − 1) − log r: (0.5 − 1) + ln 2 = ln 2 − 0.5 ; (2 − 1) − ln 2 = 1 − ln 2
    assert_close(k3(logprobs, ref), torch.tensor([[LN2 - 0.5, 1 - LN2]]))
    # |log r| = ln 2 for both
    assert_close(kl_abs(logprobs, ref), torch.tensor([[LN2, LN2]]))


def test_low_var_kl_clamps_like_verl():
    # log r = 3: k3 = e³ − 1 − 3 = 16.0855 -> clamped to 10
    # log r = 25: log r first clamped to 20, e²⁰ − 21 huge -> clamped to 10
    # log r = −1: k3 = e⁻¹ − 1 + 1 = 0.3679, inside the clamp
    logprobs = torch.zeros(1, 3, requires_grad=True)
    ref = torch.tensor([[3.0, 25.0, -1.0]])
    out = low_var_kl(logprobs, ref)
    assert_close(out.detach(), torch.tensor([[10.0, 10.0, math.exp(-1)]]))
    assert_close(k3(logprobs, ref)[0, 0].detach(), torch.tensor(math.exp(3) - 4))
    # clamped tokens get no gradient; d k3 / d logprobs = 1 − r = 1 − e⁻¹ on the last
    out.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 1 - math.exp(-1)]]))


# ---------------------------------------------------------------- estimators: loop reference


def _loop_estimate(name: str, lp: float, ref: float) -> float:
    log_r = ref - lp
    r = math.exp(log_r)
    return {
        "k1": -log_r,
        "k2": 0.5 * log_r * log_r,
        "k3": (r - 1) - log_r,
        "kl_abs": abs(log_r),
        "low_var_kl": min(max((math.exp(min(max(log_r, -20), 20)) - 1) - log_r, -10), 10),
    }[name]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", ESTIMATORS, ids=["k1", "k2", "k3", "kl_abs", "low_var_kl"])
def test_estimators_match_loop(seed, estimator):
    name = getattr(estimator, "__name__", "low_var_kl")
    g = torch.Generator().manual_seed(seed)
    logprobs = torch.randn(4, 6, generator=g, dtype=torch.float64) * 2
    ref = torch.randn(4, 6, generator=g, dtype=torch.float64) * 2
    expected = torch.tensor(
        [[_loop_estimate(name, a, b) for a, b in zip(r1, r2)] for r1, r2 in zip(logprobs, ref)],
        dtype=torch.float64,
    )
    assert_close(estimator(logprobs, ref), expected)


# ---------------------------------------------------------------- estimators: limits


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimators_zero_when_policies_agree(estimator):
    logprobs = -torch.rand(3, 5) * 4
    assert_close(estimator(logprobs, logprobs.clone()), torch.zeros(3, 5))


def test_estimators_return_float32_for_bf16_inputs():
    logprobs = -torch.rand(2, 3).bfloat16()
    for estimator in ESTIMATORS:
        assert estimator(logprobs, logprobs * 2).dtype == torch.float32


def test_k2_k3_abs_never_negative():
    logprobs, ref, _ = _random_batch(0, b=50, t=50)
    for estimator in (k2, k3, kl_abs):
        assert (estimator(logprobs, ref) >= 0).all()
    assert (k1(logprobs, ref) < 0).any()  # k1 can be negative


def _categorical(seed: int, v: int = 6):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(v, generator=g, dtype=torch.float64), -1)
    return theta, ref


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k1_k3_unbiased_k2_not(seed):
    # E_{y∼π}[k(y)] taken exactly as Σ_y π(y) k(y) over a categorical of 6 outcomes.
    theta, ref = _categorical(seed)
    logp = torch.log_softmax(theta, -1).detach()
    p = logp.exp()
    exact = (p * (logp - ref)).sum()  # KL(π ‖ π_ref)
    assert_close((p * k1(logp, ref)).sum(), exact)
    assert_close((p * k3(logp, ref)).sum(), exact)
    assert not torch.isclose((p * k2(logp, ref)).sum(), exact)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_loss_expected_gradients(seed):
    # The pitfalls of Tang & Munos 2025, checked exactly: Σ_y π(y)·∇_θ k(y) with y held fixed.
    theta, ref = _categorical(seed)
    p = torch.softmax(theta, -1).detach()
    mask = torch.ones(1, theta.shape[0], dtype=torch.bool)

    def expected_grad(estimator):
        logp = torch.log_softmax(theta, -1)
        loss, _ = kl_loss(logp[None], ref[None], mask, estimator=estimator)
        return torch.autograd.grad((p * loss[0]).sum(), theta)[0]

    logp = torch.log_softmax(theta, -1)
    reverse_kl = (logp.exp() * (logp - ref)).sum()  # KL(π ‖ π_ref)
    forward_kl = (ref.exp() * (ref - logp)).sum()  # KL(π_ref ‖ π)
    reverse = torch.autograd.grad(reverse_kl, theta, retain_graph=True)[0]
    forward = torch.autograd.grad(forward_kl, theta)[0]
    assert_close(expected_grad(k1), torch.zeros_like(theta))  # k1: zero in expectation
    assert_close(expected_grad(k2), reverse)  # k2: the reverse-KL gradient
    assert_close(expected_grad(k3), forward)  # k3: the forward-KL gradient
    assert not torch.allclose(forward, reverse)


# ---------------------------------------------------------------- kl_loss


def test_kl_loss_hand_worked():
    # valid tokens: log r = −ln 2 (k3 = ln 2 − 0.5) and log r = +ln 2 (k3 = 1 − ln 2);
    # the masked token would give k3 = e − 2 but must be 0.
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.5), 1.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, metrics = kl_loss(logprobs, ref, mask)
    assert_close(loss.detach(), torch.tensor([[LN2 - 0.5, 1 - LN2, 0.0]]))
    # metric: mean over the 2 valid tokens = (ln 2 − 0.5 + 1 − ln 2)/2 = 0.25
    assert_close(metrics["kl"], torch.tensor(0.25))
    assert metrics["kl"].dtype == torch.float32 and not metrics["kl"].requires_grad
    loss.sum().backward()
    # ∂k3/∂logprobs = 1 − r: 1 − 0.5 = 0.5 ; 1 − 2 = −1 ; masked 0
    assert_close(logprobs.grad, torch.tensor([[0.5, -1.0, 0.0]]))
    assert ref.grad is None  # the reference is detached


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_loss_matches_loop(seed):
    logprobs, ref, mask = _random_batch(seed)
    loss, metrics = kl_loss(logprobs, ref, mask, estimator=k2)
    expected = torch.zeros_like(loss)
    values = []
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                expected[i, t] = _loop_estimate("k2", logprobs[i, t].item(), ref[i, t].item())
                values.append(expected[i, t].item())
    assert_close(loss, expected)
    assert_close(metrics["kl"], torch.tensor(sum(values) / len(values)))


def test_kl_loss_zero_when_policies_agree():
    logprobs, _, mask = _random_batch(3)
    loss, metrics = kl_loss(logprobs, logprobs.clone(), mask)
    assert_close(loss, torch.zeros_like(loss))
    assert_close(metrics["kl"], torch.tensor(0.0))


# ---------------------------------------------------------------- kl_penalty_rewards


def test_kl_penalty_rewards_hand_worked():
    # coef 0.1, k1 = logprobs − ref_logprobs.
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -1.0], [-1.0, -1.0, -1.0, -1.0], [-3.0] * 4])
    ref = torch.tensor([[-2.0, -1.0, -1.0, -1.0], [-1.5, -1.0, -1.0, -1.0], [-1.0] * 4])
    mask = torch.tensor(
        [[True, True, False, True], [True, False, False, False], [False] * 4]
    )  # row 0 has a hole, row 1 one token, row 2 none
    rewards = torch.tensor([1.0, -1.0, 5.0])
    out, metrics = kl_penalty_rewards(rewards, logprobs, ref, mask, kl_coef=0.1)
    # row 0: k1 = [1, −1, ·, 0] -> −0.1·k1 = [−0.1, 0.1, 0, 0], reward 1 on the last valid t=3
    # row 1: k1 = [0.5] -> −0.05, plus the reward −1 on t=0 -> −1.05
    # row 2: nothing valid -> all zero, the reward 5 is dropped
    expected = torch.tensor([[-0.1, 0.1, 0.0, 1.0], [-1.05, 0, 0, 0], [0.0, 0, 0, 0]])
    assert_close(out, expected)
    # kl: mean over the 4 valid tokens of [1, −1, 0, 0.5] = 0.125
    # kl_per_seq: rows with a token: (1 − 1 + 0) and 0.5 -> mean 0.25; kl_penalty = −0.025
    assert_close(metrics["kl"], torch.tensor(0.125))
    assert_close(metrics["kl_per_seq"], torch.tensor(0.25))
    assert_close(metrics["kl_penalty"], torch.tensor(-0.025))


def _loop_penalty_rewards(rewards, logprobs, ref, mask, coef):
    out = torch.zeros(mask.shape)
    for i in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[i, t]]
        for t in valid:
            out[i, t] = -coef * (logprobs[i, t].item() - ref[i, t].item())
            if rewards.dim() == 2:
                out[i, t] += rewards[i, t].item()
        if rewards.dim() == 1 and valid:
            out[i, valid[-1]] += rewards[i].item()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("per_token", [False, True])
def test_kl_penalty_rewards_matches_loop(seed, per_token):
    logprobs, ref, mask = _random_batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    shape = mask.shape if per_token else mask.shape[:1]
    rewards = torch.randn(shape, generator=g)
    out, _ = kl_penalty_rewards(rewards, logprobs, ref, mask, kl_coef=0.05)
    assert_close(out, _loop_penalty_rewards(rewards, logprobs, ref, mask, 0.05))


def test_kl_penalty_rewards_limits():
    logprobs, ref, mask = _random_batch(4)
    logprobs.requires_grad_(True)
    rewards = torch.randn(mask.shape[0])
    # policies agree: only the outcome reward remains, and each row sums to its reward
    out, metrics = kl_penalty_rewards(rewards, logprobs, logprobs.detach().clone(), mask, kl_coef=1)
    has_token = mask.any(-1)
    assert_close(out.sum(-1), torch.where(has_token, rewards, 0.0))
    assert_close(metrics["kl"], torch.tensor(0.0))
    # coef 0: the same, whatever the KL; the result is detached
    out0, _ = kl_penalty_rewards(rewards, logprobs, ref, mask, kl_coef=0.0)
    assert_close(out0, out)
    assert not out0.requires_grad
    # with k1 the summed penalty is −coef·log(π_θ(y)/π_ref(y)) of the whole response
    out2, _ = kl_penalty_rewards(torch.zeros_like(rewards), logprobs, ref, mask, kl_coef=0.3)
    seq_log_ratio = ((logprobs.detach() - ref) * mask).sum(-1)
    assert_close(out2.sum(-1), -0.3 * seq_log_ratio)


# ---------------------------------------------------------------- controllers


def test_adaptive_controller_hand_worked():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    # KL 9: e = clip(9/6 − 1 = 0.5) = 0.2 ; β = 0.1·(1 + 0.2·256/10000) = 0.1·1.00512
    assert_close(ctl.update(9.0, 256), 0.100512)
    # KL 5.4: e = 5.4/6 − 1 = −0.1 ; β = 0.100512·(1 − 0.1·0.0256) = 0.100512·0.99744
    assert_close(ctl.update(torch.tensor(5.4), 256), 0.100512 * 0.99744)
    # KL 0: e = clip(−1) = −0.2 ; β ·= 1 − 0.2·0.0256 = 0.99488
    assert_close(ctl.update(0.0, 256), 0.100512 * 0.99744 * 0.99488)
    assert_close(ctl.value, 0.100512 * 0.99744 * 0.99488)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adaptive_controller_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    kls = (torch.rand(20, generator=g) * 4).tolist()
    steps = torch.randint(1, 512, (20,), generator=g).tolist()
    ctl = AdaptiveKLController(0.2, target=1.5, horizon=2000)
    beta = 0.2
    for kl, n in zip(kls, steps):
        error = kl / 1.5 - 1
        if error > 0.2:
            error = 0.2
        elif error < -0.2:
            error = -0.2
        beta = beta * (1 + error * n / 2000)
        ctl.update(kl, n)
    assert_close(ctl.value, beta)


def test_controller_limits_and_state():
    ctl = AdaptiveKLController(0.05, target=2.0, horizon=100)
    assert ctl.update(2.0, 64) == 0.05  # on target: unchanged
    ctl.update(10.0, 10)  # 0.05·(1 + 0.2·0.1) = 0.051
    assert_close(ctl.value, 0.051)
    restored = AdaptiveKLController(1.0, target=2.0, horizon=100)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    assert restored.update(0.5, 7) == ctl.update(0.5, 7)  # resumes identically
    fixed = FixedKLController(0.3)
    assert fixed.update(100.0, 1000) == 0.3 and fixed.value == 0.3
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.0  # a fixed β is configuration: a resumed run keeps the one it asks
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_masked_out_nan_and_inf_never_leak():
    # Masked-out log-probs may be −inf or NaN (padding, tool tokens): loss, metrics and
    # gradient must stay finite and equal to those of a clean batch.
    logprobs, ref, mask = _random_batch(6)
    dirty_lp = torch.where(mask, logprobs, float("nan")).requires_grad_(True)
    dirty_ref = torch.where(mask, ref, float("-inf"))
    clean_lp = logprobs.clone().requires_grad_(True)
    for estimator in ESTIMATORS:
        loss, metrics = kl_loss(dirty_lp, dirty_ref, mask, estimator=estimator)
        clean, clean_metrics = kl_loss(clean_lp, ref, mask, estimator=estimator)
        assert_close(loss, clean)
        assert_close(metrics, clean_metrics)
        (grad,) = torch.autograd.grad(loss.sum(), dirty_lp)
        (clean_grad,) = torch.autograd.grad(clean.sum(), clean_lp)
        assert_close(grad, clean_grad)
    rewards = torch.randn(mask.shape[0])
    out, metrics = kl_penalty_rewards(rewards, dirty_lp, dirty_ref, mask, kl_coef=0.1)
    clean_out, clean_metrics = kl_penalty_rewards(rewards, logprobs, ref, mask, kl_coef=0.1)
    assert_close(out, clean_out)
    assert_close(metrics, clean_metrics)


# ---------------------------------------------------------------------- kl_regularized
def test_kl_regularized_hand_worked():
    # β = 0.5, k1 = log π − log π_ref. Token 0: lp = −1, ref = −2: k1 = 1, term 0.5.
    # Token 1: lp = −1, ref = −0.5: k1 = −0.5, term −0.25. Token 2 masked: 0.
    # ratio = 1 (old = lp), A = [1, 2]: the clipped surrogate is −A = [−1, −2].
    lp = torch.tensor([[-1.0, -1.0, -3.0]])
    ref = torch.tensor([[-2.0, -0.5, -1.0]])
    adv = torch.tensor([[1.0, 2.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    loss_fn = kl_regularized(clipped_surrogate, kl_coef=0.5, estimator=k1)
    loss, metrics = loss_fn(lp, lp, adv, mask, ref_logprobs=ref)
    assert_close(loss, torch.tensor([[-1.0 + 0.5, -2.0 - 0.25, 0.0]]))
    assert_close(metrics["kl_loss"], torch.tensor(0.25))  # (1 − 0.5) / 2
    assert "clip_frac" in metrics
    # Limit: β = 0 gives back the wrapped loss.
    plain, _ = clipped_surrogate(lp, lp, adv, mask)
    assert_close(
        kl_regularized(clipped_surrogate, kl_coef=0.0)(lp, lp, adv, mask, ref_logprobs=ref)[0],
        plain,
    )


def test_kl_regularized_forwards_what_the_wrapped_loss_takes():
    seen = {}

    def wants_entropy(logprobs, old_logprobs, advantages, mask, /, *, entropy):
        seen["entropy"] = entropy
        return torch.zeros_like(logprobs), {}

    x = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss_fn = kl_regularized(wants_entropy, kl_coef=1.0)
    # The wrapped loss gets entropy; rollout_logprobs, which it does not take, is dropped.
    loss_fn(x, x, x, mask, ref_logprobs=x, entropy=x + 3, rollout_logprobs=x)
    assert_close(seen["entropy"], x + 3)
    inputs = loss_inputs(loss_fn)
    # The trainer must supply the reference, and the entropy the wrapped loss requires; it is
    # not told that the wrapper takes rollout_logprobs, which nothing reads.
    assert inputs.required == inputs.accepted == {"ref_logprobs", "entropy"}


def test_kl_regularized_is_a_loss_and_the_recipes_reexport_it():
    # A loss combinator lives with the losses; rb.recipes.kl_regularized (older docs and
    # notebooks) is the same function, not a copy.
    import rlblocks as rb

    assert rb.losses.kl_regularized is kl_regularized
    assert rb.recipes.kl_regularized is kl_regularized


# ---------------------------------------------------------------------- in the trainer
def _kl_by_hand(logprobs, old_logprobs, advantages, mask, /, *, ref_logprobs):
    """What kl_regularized(partial(clipped_surrogate, clip=(0.2, 0.28)), kl_coef=0.1) computes,
    written out: a loss that plainly takes no entropy."""
    pg, metrics = clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip=(0.2, 0.28))
    kl, _ = kl_loss(logprobs, ref_logprobs, mask, estimator=k3)
    return pg + 0.1 * kl, metrics


def test_kl_regularized_makes_the_trainer_compute_no_entropy_unless_asked():
    # The wrapper took **inputs, which the trainer read as "takes entropy": every step paid
    # for the entropy (a float32 pass over the vocabulary, with its gradient) and reported it
    # although log_entropy was off. Now its signature names ref_logprobs and what the wrapped
    # loss takes.
    from builders import ragged_rollouts, tiny_trainer

    loss_fn = kl_regularized(partial(clipped_surrogate, clip=(0.2, 0.28)), kl_coef=0.1)
    assert loss_inputs(loss_fn).accepted == {"ref_logprobs"}
    ro = ragged_rollouts(8, seed=1)
    advantages = torch.linspace(-1, 1, 8)
    wrapped, by_hand = (tiny_trainer(reference="copy", micro_batch_size=4) for _ in range(2))
    metrics = wrapped.step(ro, advantages, loss_fn=loss_fn)
    expected = by_hand.step(ro, advantages, loss_fn=_kl_by_hand)
    assert "entropy" not in metrics and "entropy" not in expected
    # The same update as the loss written out, bit for bit.
    assert metrics["loss"] == expected["loss"] and metrics["grad_norm"] == expected["grad_norm"]
    for (name, a), (_, b) in zip(wrapped.named_weights(), by_hand.named_weights(), strict=True):
        assert torch.equal(a, b), name
    # Asked for, the entropy is logged: the mean over valid tokens of the distributions the
    # update scored (one optimizer step: the weights before it).
    logged = tiny_trainer(reference="copy", micro_batch_size=8, log_entropy=True)
    _, entropy = logged.logprobs(ro, entropy=True)
    metrics = logged.step(ro, advantages, loss_fn=loss_fn)
    mean = float(entropy[ro.response_mask].mean())
    assert metrics["entropy"] == pytest.approx(mean, rel=1e-6)
