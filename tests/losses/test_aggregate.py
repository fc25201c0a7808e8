import pytest
import torch
from torch.testing import assert_close

from rlblocks.losses.aggregate import (
    AGGREGATIONS,
    SeqMeanTokenSumNorm,
    aggregate,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)

MODES = [token_mean, seq_mean_token_sum, seq_mean_token_mean, seq_mean_token_sum_norm]
MODES += [SeqMeanTokenSumNorm(max_tokens=16)]
IDS = ["token_mean", "seq_sum", "seq_mean", "seq_sum_norm", "seq_sum_norm16"]


def _random_batch(seed: int, b: int = 8, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.6
    mask[0] = False  # a row with nothing valid
    mask[1] = False
    mask[1, 2] = True  # a row with exactly one valid token
    mask[2] = True
    perm = torch.randperm(b, generator=g)
    return loss[perm], mask[perm]


def test_hand_worked():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    # valid losses: row 0 -> 1, 2 ; row 1 -> 4 ; row 2 has none and is not a sequence
    # token_mean: (1 + 2 + 4) / 3 tokens
    assert_close(aggregate(loss, mask), torch.tensor(7 / 3))
    # seq_mean_token_sum: (3 + 4) / 2 sequences
    assert_close(aggregate(loss, mask, mode=seq_mean_token_sum), torch.tensor(3.5))
    # seq_mean_token_mean: (3/2 + 4/1) / 2
    assert_close(aggregate(loss, mask, mode=seq_mean_token_mean), torch.tensor(2.75))
    # seq_mean_token_sum_norm, C = t = 3: 7 / (2·3) ; C = 10: 7 / (2·10)
    assert_close(aggregate(loss, mask, mode=seq_mean_token_sum_norm), torch.tensor(7 / 6))
    norm10 = SeqMeanTokenSumNorm(max_tokens=10)
    assert_close(aggregate(loss, mask, mode=norm10), torch.tensor(7 / 20))
    # normalizers: 3 tokens, 2 sequences, 2·3
    assert_close(token_mean.normalizer(mask), torch.tensor(3.0))
    assert_close(seq_mean_token_mean.normalizer(mask), torch.tensor(2.0))
    assert_close(seq_mean_token_sum_norm.normalizer(mask), torch.tensor(6.0))
    # an explicit normalizer replaces the batch's own: (1 + 2 + 4) / 14
    assert_close(aggregate(loss, mask, normalizer=14.0), torch.tensor(0.5))


def _loop_aggregate(loss, mask, name, max_tokens=None):
    rows = [
        [loss[i, t].item() for t in range(loss.shape[1]) if mask[i, t]] for i in range(len(loss))
    ]
    rows = [r for r in rows if r]
    n_tokens = sum(len(r) for r in rows)
    if not rows:
        return 0.0
    if name == "token_mean":
        return sum(sum(r) for r in rows) / n_tokens
    if name == "seq_sum":
        return sum(sum(r) for r in rows) / len(rows)
    if name == "seq_mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    constant = loss.shape[1] if max_tokens is None else max_tokens
    return sum(sum(r) for r in rows) / (len(rows) * constant)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("mode,name", zip(MODES, IDS), ids=IDS)
def test_matches_loop(seed, mode, name):
    loss, mask = _random_batch(seed)
    max_tokens = 16 if name == "seq_sum_norm16" else None
    name = "seq_sum_norm" if name == "seq_sum_norm16" else name
    expected = _loop_aggregate(loss, mask, name, max_tokens)
    assert_close(aggregate(loss, mask, mode=mode), torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_micro_batches_sum_to_the_mini_batch(seed, mode):
    loss, mask = _random_batch(seed)
    full = aggregate(loss, mask, mode=mode)
    normalizer = mode.normalizer(mask)
    g = torch.Generator().manual_seed(seed)
    for sizes in ([1] * 8, [4, 4], [3, 1, 4], [2, 6]):
        order = torch.randperm(8, generator=g)  # micro-batches need not be contiguous rows
        parts = torch.split(order, sizes)
        total = sum(aggregate(loss[p], mask[p], mode=mode, normalizer=normalizer) for p in parts)
        assert_close(total, full)


def test_naive_per_micro_batch_normalization_differs():
    # The negative control: normalize each micro-batch by its own token count, then average.
    loss, mask = _random_batch(0)
    halves = (torch.arange(0, 4), torch.arange(4, 8))
    assert mask[halves[0]].sum() != mask[halves[1]].sum()
    naive = sum(aggregate(loss[h], mask[h]) for h in halves) / 2
    assert not torch.isclose(naive, aggregate(loss, mask))


def test_limits():
    loss, mask = _random_batch(4)
    # nothing valid: every mode gives 0, not NaN, and no gradient
    empty = torch.zeros_like(mask)
    for mode in MODES:
        assert_close(aggregate(loss, empty, mode=mode), torch.tensor(0.0, dtype=torch.float64))
    # all rows of equal length L: the per-sequence mean, Dr. GRPO with C = L and the token mean
    # coincide, and seq_mean_token_sum is L times the token mean
    full = torch.ones_like(mask)
    tm = aggregate(loss, full)
    assert_close(aggregate(loss, full, mode=seq_mean_token_mean), tm)
    assert_close(aggregate(loss, full, mode=seq_mean_token_sum_norm), tm)
    assert_close(aggregate(loss, full, mode=seq_mean_token_sum), tm * mask.shape[1])
    # masked values, even NaN, never leak
    poisoned = torch.where(mask, loss, float("nan"))
    for mode in MODES:
        assert_close(aggregate(poisoned, mask, mode=mode), aggregate(loss, mask, mode=mode))


def test_gradient_flows_only_to_valid_tokens():
    loss, mask = _random_batch(5)
    loss.requires_grad_(True)
    aggregate(loss, mask, mode=seq_mean_token_mean).backward()
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    n_seqs = mask.any(-1).sum()
    # ∂/∂ℓ_it = 1 / (L_i · N_seqs) on valid tokens, 0 elsewhere
    assert_close(loss.grad, (mask / (lengths * n_seqs)).double())


def test_registry_and_modes_are_values():
    assert AGGREGATIONS == {
        "token-mean": token_mean,
        "seq-mean-token-sum": seq_mean_token_sum,
        "seq-mean-token-mean": seq_mean_token_mean,
        "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
    }
    assert SeqMeanTokenSumNorm(max_tokens=8) == SeqMeanTokenSumNorm(max_tokens=8)
    with pytest.raises(AttributeError):
        token_mean.x = 1  # frozen
