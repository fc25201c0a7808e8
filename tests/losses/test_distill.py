"""The reverse KL of on-policy distillation, and its advantage, against a slow loop."""

import math

import pytest
import torch

import rlblocks as rb


def slow_reverse_kl(student_logits, teacher_logits, tokens, mask):
    """d[i][t] = log softmax(student)[y] − log softmax(teacher)[y], one token at a time in
    Python floats: log softmax(z)[y] = z[y] − log Σ_v exp(z[v])."""
    b, t, _ = student_logits.shape
    out = [[0.0] * t for _ in range(b)]
    for i in range(b):
        for k in range(t):
            if not mask[i][k]:
                continue
            y = int(tokens[i][k])
            s = student_logits[i][k].tolist()
            te = teacher_logits[i][k].tolist()
            log_zs = math.log(sum(math.exp(z) for z in s))
            log_zt = math.log(sum(math.exp(z) for z in te))
            out[i][k] = (s[y] - log_zs) - (te[y] - log_zt)
    return torch.tensor(out, dtype=torch.float64)


def logprobs_of(logits, tokens):
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    b, t, v = 3, 5, 11
    student = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    return student, teacher, tokens, mask


def test_reverse_kl_equals_the_slow_loop_on_random_logits(batch):
    student, teacher, tokens, mask = batch
    d, metrics = rb.losses.reverse_kl(
        logprobs_of(student, tokens), logprobs_of(teacher, tokens), mask
    )
    expected = slow_reverse_kl(student, teacher, tokens, mask)
    torch.testing.assert_close(d, expected, rtol=1e-12, atol=1e-12)
    assert float(metrics["distill/reverse_kl"]) == pytest.approx(
        expected[mask].mean().item(), rel=1e-6
    )


def test_reverse_kl_is_zero_when_student_and_teacher_agree(batch):
    student, _, tokens, mask = batch
    lp = logprobs_of(student, tokens)
    d, metrics = rb.losses.reverse_kl(lp, lp.clone(), mask)
    assert torch.equal(d, torch.zeros_like(d)) and metrics["distill/reverse_kl"] == 0
    advantages, _ = rb.advantage.teacher_kl(lp, lp.clone(), mask)
    assert torch.equal(advantages, torch.zeros_like(advantages))


def test_reverse_kl_estimates_the_exact_kl_on_average():
    """E_{y∼π_s}[log π_s(y) − log π_T(y)] = KL(π_s ‖ π_T): averaged over many sampled tokens
    the estimate meets Σ_v π_s (log π_s − log π_T), within 4 standard errors."""
    g = torch.Generator().manual_seed(1)
    s, te = torch.randn(7, generator=g), torch.randn(7, generator=g)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(te, -1)
    exact = (ls.exp() * (ls - lt)).sum()
    n = 200_000
    y = torch.multinomial(ls.exp(), n, replacement=True, generator=g)
    d, _ = rb.losses.reverse_kl(ls[y][None], lt[y][None], torch.ones(1, n, dtype=torch.bool))
    stderr = d.std() / math.sqrt(n)
    assert abs(d.mean() - exact) < 4 * stderr


def test_the_advantage_is_minus_coef_times_the_reverse_kl(batch):
    student, teacher, tokens, mask = batch
    s, t = logprobs_of(student, tokens), logprobs_of(teacher, tokens)
    d, _ = rb.losses.reverse_kl(s, t, mask)
    advantages, returns = rb.advantage.teacher_kl(s, t, mask, kl_coef=0.5)
    torch.testing.assert_close(advantages, (-0.5 * d).float())
    assert advantages.dtype == torch.float32 and not advantages.requires_grad
    assert (advantages[~mask] == 0).all() and torch.equal(advantages, returns)
    with pytest.raises(ValueError, match="kl_coef=-1.0 is negative; use kl_coef >= 0"):
        rb.advantage.teacher_kl(s, t, mask, kl_coef=-1.0)


def test_the_advantage_gives_the_reverse_kl_gradient():
    """With ℓ = −A · π_θ/π_old (A from the advantage, taken at π_old = π_θ), the gradient is
    Σ_y π_s(y) (log π_s(y) − log π_T(y)) ∇ log π_s(y) summed over all y weighted by π_s: the
    exact ∇ KL(π_s ‖ π_T) of one position. Checked exactly by enumerating every token."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    lt = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    ls = torch.log_softmax(z, -1)
    kl = (ls.exp() * (ls - lt)).sum()
    (exact,) = torch.autograd.grad(kl, z)
    y = torch.arange(6)
    weights = ls.exp().detach()
    lp = torch.log_softmax(z, -1)[y]
    adv, _ = rb.advantage.teacher_kl(lp.detach()[None], lt[y][None], torch.ones(1, 6).bool())
    loss = -(weights * adv[0].double() * torch.exp(lp - lp.detach())).sum()
    (via_advantage,) = torch.autograd.grad(loss, z)
    torch.testing.assert_close(via_advantage, exact)
