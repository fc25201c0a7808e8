import itertools
import math

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from rlblocks.losses.entropy import (
    entropy_from_logits,
    entropy_loss,
    linear_token_scores,
    token_logprobs,
)

LN3 = math.log(3.0)


def _naive_entropy(logits):
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)


def _naive_logprobs(logits, ids):
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0]


def _logits(seed, shape=(3, 5, 11), dtype=torch.float32, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


# ---------------------------------------------------------------- entropy: hand-worked


def test_entropy_hand_worked():
    # logits [0, ln 3] -> p = [1/4, 3/4]: H = −(¼ ln ¼ + ¾ ln ¾) = ¼ ln 4 + ¾ ln(4/3)
    # logits [c, c, c, c] -> uniform over 4: H = ln 4
    # logits [30, 0, 0, 0] -> p ≈ [1, e⁻³⁰ ...]: H ≈ 3·e⁻³⁰·31 ≈ 0
    logits = torch.tensor([[[0.0, LN3, -1e4, -1e4], [2.0, 2.0, 2.0, 2.0], [30.0, 0.0, 0.0, 0.0]]])
    expected = torch.tensor([[0.25 * math.log(4) + 0.75 * math.log(4 / 3), math.log(4), 0.0]])
    assert_close(entropy_from_logits(logits, chunk_size=2), expected)


# ---------------------------------------------------------------- entropy: loop reference


def _loop_entropy(logits):
    out = torch.zeros(logits.shape[:-1], dtype=torch.float64)
    for idx in itertools.product(*map(range, logits.shape[:-1])):
        row = [float(x) for x in logits[idx]]
        top = max(row)
        weights = [math.exp(x - top) for x in row]
        total = sum(weights)
        out[idx] = -sum(w / total * math.log(w / total) for w in weights if w > 0)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 15, 1000])  # 15 rows: 4 and 7 don't divide
def test_entropy_matches_loop(seed, chunk_size):
    logits = _logits(seed, dtype=torch.float64)
    assert_close(entropy_from_logits(logits, chunk_size=chunk_size), _loop_entropy(logits))


@pytest.mark.parametrize("seed", [0, 1])
def test_entropy_matches_naive_float32_and_bf16(seed):
    logits = _logits(seed, shape=(4, 9, 37))
    assert_close(entropy_from_logits(logits, chunk_size=5), _naive_entropy(logits))
    # bf16 logits: identical to the naive formula on the float32-upcast logits
    bf16 = logits.bfloat16()
    out = entropy_from_logits(bf16, chunk_size=5)
    assert out.dtype == torch.float32
    assert_close(out, _naive_entropy(bf16.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 6, 100])
def test_entropy_gradient_matches_naive(dtype, chunk_size):
    logits = _logits(3, shape=(2, 7, 13), dtype=dtype).requires_grad_(True)
    weights = torch.randn(2, 7, dtype=dtype)
    (grad,) = torch.autograd.grad(
        (entropy_from_logits(logits, chunk_size=chunk_size) * weights).sum(), logits
    )
    (expected,) = torch.autograd.grad((_naive_entropy(logits) * weights).sum(), logits)
    assert_close(grad, expected)


def test_entropy_bf16_gradient_keeps_dtype():
    logits = _logits(4, shape=(2, 3, 8)).bfloat16().requires_grad_(True)
    entropy_from_logits(logits, chunk_size=4).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = logits.detach().float().requires_grad_(True)
    _naive_entropy(ref).sum().backward()
    assert_close(logits.grad, ref.grad.bfloat16())


# ---------------------------------------------------------------- entropy: limits


def test_entropy_limits():
    v = 50
    uniform = torch.full((2, 3, v), -1.7)
    assert_close(entropy_from_logits(uniform, chunk_size=4), torch.full((2, 3), math.log(v)))
    peaked = torch.zeros(2, 3, v)
    peaked[..., 7] = 200.0
    assert_close(entropy_from_logits(peaked, chunk_size=4), torch.zeros(2, 3))
    # invariant to a shift of the logits (float64: in float32, x + 100 itself rounds x by
    # ~1e-5, which would test the input rounding instead); no rows gives an empty result
    logits = _logits(5, dtype=torch.float64)
    assert_close(entropy_from_logits(logits + 100.0), entropy_from_logits(logits))
    assert entropy_from_logits(torch.zeros(0, 4, 9)).shape == (0, 4)
    with pytest.raises(ValueError):
        entropy_from_logits(logits, chunk_size=0)


class _Float32Sizes(TorchDispatchMode):
    """Records the largest float32 tensor produced by any op (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("fn", ["entropy", "logprobs"])
@pytest.mark.parametrize("grad", [False, True])
def test_no_full_float32_copy_of_bf16_logits(fn, grad):
    # (b t v) = (4 8 64) bf16 logits, chunks of 5 rows: no op, forward or backward, may create
    # a float32 tensor larger than 5·64 elements (a full float32 copy would be 2048).
    b, t, v, chunk = 4, 8, 64, 5
    logits = _logits(6, shape=(b, t, v)).bfloat16().requires_grad_(grad)
    ids = torch.randint(0, v, (b, t))
    sizes = _Float32Sizes()
    with sizes:
        out = (
            entropy_from_logits(logits, chunk_size=chunk)
            if fn == "entropy"
            else (token_logprobs(logits, ids, chunk_size=chunk))
        )
        if grad:
            out.sum().backward()
    assert 0 < sizes.largest <= chunk * v
    naive = _Float32Sizes()
    with naive, torch.no_grad():
        _naive_entropy(logits)
    assert naive.largest == b * t * v  # the naive formula does make one: the probe works


# ---------------------------------------------------------------- token_logprobs


def test_token_logprobs_hand_worked():
    # logits [0, ln 3] -> p = [1/4, 3/4]: log p[1] = ln ¾, log p[0] = ln ¼
    # logits [5, 5, 5] -> log ⅓ whatever the id
    logits = torch.tensor([[[0.0, LN3, -1e4], [5.0, 5.0, 5.0]], [[0.0, LN3, -1e4], [0, 0, 0]]])
    ids = torch.tensor([[1, 2], [0, 0]])
    expected = torch.tensor([[math.log(0.75), -LN3], [math.log(0.25), -LN3]])
    assert_close(token_logprobs(logits, ids, chunk_size=3), expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1000])
def test_token_logprobs_matches_loop(seed, chunk_size):
    logits = _logits(seed, dtype=torch.float64)
    ids = torch.randint(
        0, logits.shape[-1], logits.shape[:-1], generator=torch.Generator().manual_seed(seed)
    )
    expected = torch.zeros(ids.shape, dtype=torch.float64)
    for idx in itertools.product(*map(range, ids.shape)):
        row = [float(x) for x in logits[idx]]
        top = max(row)
        expected[idx] = row[ids[idx]] - top - math.log(sum(math.exp(x - top) for x in row))
    assert_close(token_logprobs(logits, ids, chunk_size=chunk_size), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_matches_log_softmax_gather(dtype):
    logits = _logits(7, shape=(3, 6, 40)).to(dtype)
    ids = torch.randint(0, 40, (3, 6))
    out = token_logprobs(logits, ids, chunk_size=4)
    assert out.dtype == torch.float32
    assert_close(out, torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 5, 100])
def test_token_logprobs_gradient_matches_naive(dtype, chunk_size):
    logits = _logits(8, shape=(3, 4, 9), dtype=dtype).requires_grad_(True)
    ids = torch.randint(0, 9, (3, 4))
    weights = torch.randn(3, 4, dtype=dtype)
    out = token_logprobs(logits, ids, chunk_size=chunk_size)
    (grad,) = torch.autograd.grad((out * weights).sum(), logits)
    (expected,) = torch.autograd.grad((_naive_logprobs(logits, ids) * weights).sum(), logits)
    assert_close(grad, expected)


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_token_logprobs_gradient_passes_gradcheck(chunk_size):
    # The hand-written backward against finite differences (float64), with repeated ids and a
    # non-contiguous (sliced) input as the trainer's forward gives it.
    logits = _logits(9, shape=(2, 6, 5), dtype=torch.float64)[:, 1:].requires_grad_(True)
    ids = torch.tensor([[0, 0, 4, 2, 2], [1, 3, 3, 0, 4]])
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, ids, chunk_size=chunk_size), logits)


def test_token_logprobs_limits():
    # uniform logits give −ln v; a dominant logit gives ≈ 0 for its id; no-grad equals grad path
    uniform = torch.zeros(2, 3, 16)
    ids = torch.randint(0, 16, (2, 3))
    assert_close(token_logprobs(uniform, ids), torch.full((2, 3), -math.log(16)))
    peaked = torch.zeros(1, 2, 16)
    peaked[0, :, 3] = 100.0
    assert_close(token_logprobs(peaked, torch.tensor([[3, 3]])), torch.zeros(1, 2))
    logits = _logits(9).requires_grad_(True)
    ids = torch.randint(0, 11, (3, 5))
    with torch.no_grad():
        plain = token_logprobs(logits, ids, chunk_size=4)
    assert_close(token_logprobs(logits, ids, chunk_size=4).detach(), plain)
    with pytest.raises(ValueError):
        token_logprobs(logits, ids[:, :2])


# ---------------------------------------------------------------- entropy_loss


def test_entropy_loss_hand_worked_and_limits():
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, metrics = entropy_loss(entropy, mask)
    # −H on valid tokens, 0 elsewhere; metric = mean of (1, 2, 3) = 2
    assert_close(loss.detach(), torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]]))
    assert_close(metrics["entropy"], torch.tensor(2.0))
    loss.sum().backward()
    assert_close(entropy.grad, -mask.float())
    # nothing valid: zero loss and a zero (not NaN) metric
    loss, metrics = entropy_loss(entropy, torch.zeros_like(mask))
    assert_close(loss.detach(), torch.zeros(2, 3))
    assert_close(metrics["entropy"], torch.tensor(0.0))


# ---------------------------------------------------------------- linear_token_scores


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_token_scores_match_full_logits(chunk_size, bias):
    # float64 against log_softmax of the full (n v) logits: the same arithmetic in chunks, so
    # only the summation order differs (~1e-15 for these magnitudes; 1e-12 leaves room).
    g = torch.Generator().manual_seed(11)
    n, d, v, temperature = 13, 7, 11, 0.7
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    ids = torch.randint(0, v, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g)
    leaves = [x for x in (hidden, weight, b) if x is not None]

    lp, ent = linear_token_scores(
        hidden, weight, b, ids, temperature=temperature, chunk_size=chunk_size, entropy=True
    )
    got = torch.autograd.grad((lp * g_lp + ent * g_ent.double()).sum(), leaves)
    z = torch.nn.functional.linear(hidden, weight, b) / temperature
    lp_ref, ent_ref = _naive_logprobs(z, ids), _naive_entropy(z)
    expected = torch.autograd.grad((lp_ref * g_lp + ent_ref * g_ent.double()).sum(), leaves)
    tol = {"rtol": 1e-12, "atol": 1e-12}
    assert_close(lp, lp_ref, **tol)
    assert_close(ent, ent_ref, **tol)
    for a, e in zip(got, expected, strict=True):
        assert_close(a, e, **tol)
    only_lp, none = linear_token_scores(hidden, weight, b, ids, temperature=temperature)
    assert none is None
    assert_close(only_lp, lp, **tol)


class _VocabularyWide(TorchDispatchMode):
    """Records the largest tensor whose last dimension is the vocabulary (logits and their
    gradients), produced by any op forward or backward; the head's transposed weight ``(d v)``
    is not one."""

    def __init__(self, v, d):
        super().__init__()
        self.v, self.d, self.largest = v, d, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(x, torch.Tensor)
                and x.dim() >= 2
                and x.shape[-1] == self.v
                and tuple(x.shape) != (self.d, self.v)
            ):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("packing", [False, True])
def test_a_model_is_scored_without_its_full_logits(packing):
    # The tiny model (v = 384, hidden 64), 8 rows of up to 8 response tokens, chunks of 5:
    # forward and backward, no logits-like tensor exceeds 5 · 384; the full logits of the
    # response tokens would be ≥ 20 · 384.
    from builders import ragged_rollouts

    from rlblocks.models import tiny
    from rlblocks.trainer.forward import score_responses

    model, _ = tiny(seed=0)
    v = model.config.vocab_size
    ro = ragged_rollouts(8, seed=1)
    sizes = _VocabularyWide(v, model.config.hidden_size)
    with sizes:
        lp, ent = score_responses(model, ro, chunk_size=5, entropy=True, packing=packing)
        (lp.sum() + ent.sum()).backward()
    assert 0 < sizes.largest <= 5 * v
    assert int(ro.response_attention_mask.sum()) >= 20
