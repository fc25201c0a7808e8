"""The kept set of top-k / top-p sampling (`rlblocks.losses.truncation.kept_tokens`): Hugging
Face's own warpers, bit for bit, and the sampled token always kept."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from rlblocks.losses.truncation import Truncation, kept_tokens


def hf_kept(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """What ``generate``'s warpers keep of float32 tempered logits ``z`` (n v), in its order."""
    scores = z.clone()
    if top_k:
        scores = TopKLogitsWarper(top_k=top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p=top_p)(None, scores)
    return scores != -float("inf")


def logits(n: int = 64, v: int = 384, *, seed: int = 0, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * 3
    if ties:  # many equal logits: the k-th value and the top-p edge fall on ties
        z = (z * 2).round() / 2
    return z


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(
    ("top_k", "top_p"),
    [(1, 1.0), (5, 1.0), (50, 1.0), (383, 1.0), (384, 1.0), (1000, 1.0), (0, 0.9),
     (0, 0.5), (0, 0.05), (0, 0.999), (20, 0.9), (3, 0.3), (50, 0.95)],
)  # fmt: skip
def test_kept_tokens_are_hf_warpers_bit_for_bit(top_k: int, top_p: float, ties: bool) -> None:
    z = logits(ties=ties) / 0.7  # tempered, as the warpers see them
    n = z.shape[0]
    mine = kept_tokens(z, torch.full((n,), top_k), torch.full((n,), top_p, dtype=torch.float64))
    assert torch.equal(mine, hf_kept(z, top_k, top_p))
    assert mine.all() == (top_k in (0, 384, 1000) and top_p == 1)  # k >= v keeps all


def test_per_row_rules_are_each_rows_own() -> None:
    """A batch of mixed rules keeps, per row, what that row's rule alone keeps."""
    z = logits(n=6)
    top_k = torch.tensor([0, 5, 0, 40, 1, 0])
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.9, 0.5, 0.3], dtype=torch.float64)
    mine = kept_tokens(z, top_k, top_p)
    for i in range(6):
        assert torch.equal(mine[i], hf_kept(z[i : i + 1], int(top_k[i]), float(top_p[i]))[0])
    assert mine[0].all() and int(mine[1].sum()) == 5


def test_float64_logits_use_the_float32_rule() -> None:
    z = logits().double()
    k, p = torch.full((64,), 30), torch.full((64,), 0.9, dtype=torch.float64)
    assert torch.equal(kept_tokens(z, k, p), hf_kept(z.float(), 30, 0.9))


def test_the_chosen_token_is_always_kept() -> None:
    """A sampled token just outside the trainer's kept set (rounding) stays in it."""
    z = logits(n=8)
    k, p = torch.full((8,), 5), torch.ones(8, dtype=torch.float64)
    smallest = z.argmin(-1)  # never in a top-5
    keep = kept_tokens(z, k, p, chosen=smallest)
    assert keep[torch.arange(8), smallest].all()
    assert torch.equal(keep.sum(-1), torch.full((8,), 6))
    assert torch.equal(keep & ~torch.nn.functional.one_hot(smallest, 384).bool(),
                       kept_tokens(z, k, p))  # fmt: skip


def test_greedy_rows_are_scored_untruncated() -> None:
    sampler = torch.tensor([[0.0, 5, 0.5], [0.7, 5, 0.5], [1.0, 0, 1.0]], dtype=torch.float64)
    rule = Truncation.of_rows(sampler, torch.tensor([0, 1, 1, 2]))
    assert rule.top_k.tolist() == [0, 5, 5, 0]
    assert rule.top_p.tolist() == [1.0, 0.5, 0.5, 1.0]
    assert rule.active(384).tolist() == [False, True, True, False]


# ---------------------------------------------------------------------- scoring with the rule
def rule_of(n: int, seed: int = 1) -> Truncation:
    """Mixed rules: untruncated, top-k only, top-p only, both, and top-k 1 (one token left)."""
    g = torch.Generator().manual_seed(seed)
    top_k = torch.tensor([0, 7, 0, 40, 1, 0, 3, 0])[torch.arange(n) % 8]
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.9, 1.0, 0.3, 0.95, 1.0], dtype=torch.float64)
    top_p = top_p[torch.arange(n) % 8]
    return Truncation(top_k[torch.randperm(n, generator=g)], top_p[torch.randperm(n, generator=g)])


def reference_scores(z: torch.Tensor, ids: torch.Tensor, rule: Truncation):
    """Row by row over the kept set only, plain autograd (no −inf anywhere)."""
    keep = kept_tokens(z, rule.top_k, rule.top_p, chosen=ids)
    lps, ents = [], []
    for i in range(z.shape[0]):
        kept = keep[i].nonzero()[:, 0]
        logp = torch.log_softmax(z[i, kept], dim=-1)
        lps.append(logp[(kept == ids[i]).nonzero()[0, 0]])
        ents.append(-(logp.exp() * logp).sum())
    return torch.stack(lps), torch.stack(ents)


def test_token_logprobs_and_entropy_score_the_kept_set_with_its_gradient() -> None:
    """Values and gradients, in float64, against autograd over each row's kept set; chunks of
    3 rows make the rule cross chunk boundaries."""
    from rlblocks.losses import entropy_from_logits, token_logprobs

    n, v = 16, 384
    z = (logits(n=n, v=v, seed=3).double() / 0.7).requires_grad_()
    ids = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(4))
    rule = rule_of(n)
    weights = torch.randn(n, dtype=torch.float64)
    ref_lp, ref_ent = reference_scores(z, ids, rule)
    ref_grad = torch.autograd.grad((weights * (ref_lp + 0.5 * ref_ent)).sum(), z)[0]
    lp = token_logprobs(z, ids, chunk_size=3, truncation=rule)
    ent = entropy_from_logits(z, chunk_size=3, truncation=rule, token_ids=ids)
    grad = torch.autograd.grad((weights * (lp + 0.5 * ent)).sum(), z)[0]
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    assert torch.isfinite(grad).all()
    full = token_logprobs(z.detach(), ids, chunk_size=3)  # untruncated
    active = rule.active(v)
    assert (lp.detach()[active] > full[active] + 1e-3).all()  # the kept mass is < 1
    assert torch.equal(lp.detach()[~active], full[~active])  # untruncated rows: as before


def test_linear_token_scores_score_the_kept_set_with_its_gradient() -> None:
    """The chunked projection (the trainer's path): log-probs and entropies of the truncated
    distribution and the gradients of hidden, weight and bias, against autograd in float64."""
    from torch.nn import functional as F

    from rlblocks.losses import linear_token_scores

    n, d, v, temperature = 16, 12, 384, 0.7
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(v, d, generator=g, dtype=torch.float64).requires_grad_()
    bias = torch.randn(v, generator=g, dtype=torch.float64).requires_grad_()
    ids = torch.randint(0, v, (n,), generator=g)
    rule = rule_of(n, seed=6)
    a, b = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g).double()
    ref_lp, ref_ent = reference_scores(F.linear(hidden, weight, bias) / temperature, ids, rule)
    ref = torch.autograd.grad((a * ref_lp + b * ref_ent).sum(), (hidden, weight, bias))
    lp, ent = linear_token_scores(
        hidden, weight, bias, ids, temperature=temperature, chunk_size=5, entropy=True,
        truncation=rule,
    )  # fmt: skip
    grads = torch.autograd.grad((a * lp + b * ent).sum(), (hidden, weight, bias))
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    for mine, theirs in zip(grads, ref, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-11)


def test_no_rule_or_an_untruncated_rule_is_todays_scoring_bitwise() -> None:
    from rlblocks.losses import linear_token_scores, token_logprobs

    n, d, v = 10, 8, 384
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = torch.randn(v, d, generator=g).requires_grad_()
    ids = torch.randint(0, v, (n,), generator=g)
    off = Truncation(torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.float64))
    runs = []
    for rule in (None, off):
        lp, ent = linear_token_scores(hidden, weight, None, ids, chunk_size=4, entropy=True,
                                      truncation=rule)  # fmt: skip
        lp2 = token_logprobs(hidden.detach() @ weight.detach().T, ids, truncation=rule)
        grads = torch.autograd.grad((lp + ent).sum(), (hidden, weight))
        runs.append((lp, ent, lp2, *grads))
    for x, y in zip(*runs, strict=True):
        assert torch.equal(x, y)
