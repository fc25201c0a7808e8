"""Memory-aware quantities from logits: token entropy and log-probabilities of chosen tokens.

Logits are ``(b t v)``, often bf16 and, with v ≈ 150 000, the largest tensor of a step: a
float32 copy of them (what ``logits.float().log_softmax(-1)`` makes) doubles or triples peak
memory. Both functions here flatten the rows to ``(b·t, v)`` and work on ``chunk_size`` rows at
a time, so that only one chunk is ever upcast to float32:

- without gradients, each chunk's float32 work is freed before the next chunk starts;
- with gradients, :func:`token_logprobs` keeps only the ``(n)`` logsumexps and writes its
  gradient chunk by chunk in a hand-written backward (:class:`_TokenLogprob`);
  :func:`entropy_from_logits` runs each chunk under ``torch.utils.checkpoint.checkpoint(...,
  use_reentrant=False)``: the forward keeps nothing in float32, and the backward recomputes one
  chunk at a time. The gradient reaching ``logits`` is in the logits' own dtype.

The arithmetic is done in float32, or in float64 when the logits are float64 (tests use this
to compare at tight tolerances), and the result has that dtype.

**Sampling replay** (``truncation``, :mod:`rlblocks.losses.truncation`): each token may carry
the top-k / top-p rule its engine sampled with; the scores are then those of the distribution
renormalized over the kept set K, log π_K(y) = z_y − logsumexp_{j∈K} z_j and
H_K = logsumexp_K z − Σ_{j∈K} π_K(j) z_j. Each chunk rebuilds K from its logits for its
truncated tokens only (forward and, from the recomputed logits, backward: no ``(n v)`` mask is
kept), so tokens without truncation cost nothing extra and a call without ``truncation``
runs exactly the code it ran before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rlblocks.base.masked import masked_mean
from rlblocks.losses.truncation import Truncation, kept_tokens, masked_logits

DEFAULT_CHUNK_SIZE = 1024
"""Rows (tokens) per chunk: with v = 152 064, a float32 chunk is 0.6 GB."""


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _row_entropy(logits: Tensor) -> Tensor:
    # H = logsumexp(z) − Σ_v softmax(z)_v · z_v, for rows of logits (n v) -> (n).
    z = logits.to(_compute_dtype(logits))
    lse = torch.logsumexp(z, dim=-1)
    return lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _truncated_row_entropy(logits: Tensor, ids: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    # H_K = logsumexp_K(z) − Σ_{j∈K} softmax_K(z)_j · z_j: the softmax of the masked logits is 0
    # outside K and multiplies the finite z (0 · −inf would be NaN).
    z = logits.to(_compute_dtype(logits))
    cut = _kept(z, ids, Truncation(top_k, top_p))
    if cut is None:
        return _row_entropy(logits)
    rows, keep = cut
    zk = z.index_put((rows,), masked_logits(z[rows], keep))  # out of place: autograd sees it
    return torch.logsumexp(zk, dim=-1) - (torch.softmax(zk, dim=-1) * z).sum(dim=-1)


def _kept(z: Tensor, ids: Tensor, rule: Truncation | None) -> tuple[Tensor, Tensor] | None:
    """``(rows (m), kept set (m v))`` of the rows of a chunk whose rule truncates anything
    (the chosen token always kept), None when none does: those rows cost nothing extra."""
    if rule is None:
        return None
    active = rule.active(z.shape[-1])
    if not bool(active.any()):
        return None
    rows = active.nonzero()[:, 0]
    keep = kept_tokens(z[rows], rule.top_k[rows], rule.top_p[rows], chosen=ids[rows])
    return rows, keep


def _chunked_rows(
    fn: Callable[..., Tensor], logits: Tensor, *extra: Tensor, chunk_size: int
) -> Tensor:
    """Apply ``fn(logits_rows, *extra_rows) -> (n)`` over chunks of the flattened rows."""
    if chunk_size < 1:
        raise ValueError(f"entropy_from_logits: chunk_size={chunk_size}; use chunk_size >= 1")
    lead = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    extra_rows = [x.reshape(-1) for x in extra]
    # Checkpoint only when a graph is being recorded through the logits: then it is what keeps
    # the float32 intermediates of all chunks from being saved for the backward at once.
    use_checkpoint = torch.is_grad_enabled() and logits.requires_grad
    outputs = []
    for start in range(0, rows.shape[0], chunk_size):
        args = [rows[start : start + chunk_size]]
        args += [x[start : start + chunk_size] for x in extra_rows]
        if use_checkpoint:
            outputs.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            outputs.append(fn(*args))
    if not outputs:  # no rows at all (b·t = 0)
        return logits.new_zeros(lead, dtype=_compute_dtype(logits))
    return torch.cat(outputs).reshape(lead)


def entropy_from_logits(
    logits: Tensor,
    /,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    truncation: Truncation | None = None,
    token_ids: Tensor | None = None,
) -> Tensor:
    """Entropy of the next-token distribution at every position, chunk by chunk.

    H(softmax(z)) = −Σ_v p_v log p_v = logsumexp(z) − Σ_v softmax(z)_v · z_v
    (Shannon 1948; the logsumexp form avoids log 0 and is exact for any shift of z).

    Shapes: ``logits`` ``(... v)`` (usually ``(b t v)``), any float dtype; returns ``(...)``
    float32 (float64 for float64 logits). Differentiable through ``logits`` (not detached);
    at most ``chunk_size`` rows are in float32 at a time, also in the backward pass (see the
    module docstring). Use it as an entropy bonus with :func:`entropy_loss`.

    ``truncation``: the sampler's rule of each position (flattened order), with ``token_ids``
    ``(...)`` the sampled tokens (always kept): the entropy of the truncated distribution
    (module docstring).
    """
    if truncation is None:
        return _chunked_rows(_row_entropy, logits, chunk_size=chunk_size)
    if token_ids is None or token_ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"entropy_from_logits: truncation needs token_ids shaped {tuple(logits.shape[:-1])}, "
            f"got {None if token_ids is None else tuple(token_ids.shape)}; pass the sampled "
            "tokens (they stay in the kept set)"
        )
    extra = (token_ids.long(), truncation.top_k, truncation.top_p)
    return _chunked_rows(_truncated_row_entropy, logits, *extra, chunk_size=chunk_size)


def token_logprobs(
    logits: Tensor,
    token_ids: Tensor,
    /,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    truncation: Truncation | None = None,
) -> Tensor:
    """Log-probability of the given token at every position: log softmax(z)[y], chunk by chunk.

    log π(y | ·) = z_y − logsumexp(z). Equal to
    ``torch.log_softmax(logits.float(), -1).gather(-1, token_ids[..., None])[..., 0]`` without
    the float32 ``(b t v)`` log-softmax.

    Shapes: ``logits`` ``(... v)`` (usually ``(b t v)``, already shifted so that position t
    scores token t), any float dtype; ``token_ids`` ``(...)`` int64. Returns ``(...)`` float32
    (float64 for float64 logits). Differentiable through ``logits`` (not detached; once: no
    second derivative), with at most ``chunk_size`` rows in float32 at a time, also in the
    backward pass (:class:`_TokenLogprob`). ``truncation``: the sampler's rule of each
    position (flattened order): log-probs of the truncated distribution (module docstring).
    """
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(
            f"token_logprobs: token_ids {tuple(token_ids.shape)} vs logits "
            f"{tuple(logits.shape)}; pass token_ids shaped like logits without its last (v) dim"
        )
    if chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size={chunk_size}; use chunk_size >= 1")
    v = logits.shape[-1]
    rows = logits.reshape(-1, v)
    ids = token_ids.reshape(-1).long()
    return _TokenLogprob.apply(rows, ids, chunk_size, truncation).reshape(token_ids.shape)


class _TokenLogprob(torch.autograd.Function):
    """z_y − logsumexp(z) per row of ``(n v)`` logits, with a hand-written backward.

    The gradient is ∂/∂z_j = g · (1[j = y] − softmax(z)_j). Autograd through ``logsumexp`` (or
    ``log_softmax``) would keep a float32 ``(n v)`` tensor for the backward, or, checkpointed,
    compute the logsumexp a second time; here the forward keeps only the logits it was given
    and the ``(n)`` logsumexps, and the backward makes one pass per chunk, written straight
    into the gradient: exp(z − lse), times −g, plus g at the chosen token. On SmolLM2-135M
    (v = 49 152) that is about 2 s less per GRPO update of 16 × 64 tokens on one CPU thread
    than the checkpointed form. With a ``truncation`` rule, lse is over each token's kept set
    and the softmax is 0 outside it (module docstring).
    """

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, ids: Tensor, chunk_size: int, truncation: Truncation | None
    ) -> Tensor:
        dtype = _compute_dtype(logits)
        n = logits.shape[0]
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        out = torch.empty(n, dtype=dtype, device=logits.device)
        for start in range(0, n, chunk_size):
            part = slice(start, start + chunk_size)
            z = logits[part].to(dtype)
            torch.logsumexp(z, dim=-1, out=lse[part])
            cut = _kept(z, ids[part], None if truncation is None else truncation[part])
            if cut is not None:
                rows, keep = cut
                lse[part][rows] = torch.logsumexp(masked_logits(z[rows], keep), dim=-1)
            out[part] = z.gather(-1, ids[part, None])[:, 0] - lse[part]
        ctx.save_for_backward(logits, ids, lse)
        ctx.chunk_size, ctx.truncation = chunk_size, truncation
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        logits, ids, lse = ctx.saved_tensors
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        g = grad_out.to(lse.dtype)
        truncation = ctx.truncation
        for start in range(0, logits.shape[0], ctx.chunk_size):
            part = slice(start, start + ctx.chunk_size)
            z = logits[part].to(lse.dtype)
            p = (z - lse[part, None]).exp_()  # softmax, one pass
            _zero_outside(p, z, ids[part], None if truncation is None else truncation[part])
            p.mul_(-g[part, None]).scatter_add_(-1, ids[part, None], g[part, None])
            grad[part] = p  # cast to the logits' dtype (bf16 logits get a bf16 gradient)
        return grad, None, None, None


def _zero_outside(p: Tensor, z: Tensor, ids: Tensor, rule: Truncation | None) -> None:
    """Set ``p`` = exp(z − lse_K) to 0 outside each truncated row's kept set, in place: the
    truncated softmax, its set rebuilt from the (recomputed) logits ``z``."""
    cut = _kept(z, ids, rule)
    if cut is not None:
        rows, keep = cut
        p[rows] = p[rows].masked_fill_(~keep, 0)


def entropy_loss(entropy: Tensor, mask: Tensor, /) -> tuple[Tensor, dict[str, Tensor]]:
    """Entropy bonus as a per-token loss: L_t = −H_t (minimising it raises the entropy).

    The entropy regulariser of A3C (Mnih et al. 2016, arXiv 1602.01783, sec. 4) and PPO
    (Schulman et al. 2017, arXiv 1707.06347, eq. 9, the c₂ S[π_θ] term). Add it with a
    positive coefficient: ``pg + 0.01 * entropy_loss(H, mask)[0]``.

    Shapes: ``entropy`` ``(b t)`` (from :func:`entropy_from_logits`, gradient kept), ``mask``
    ``(b t)`` bool. Returns the loss ``(b t)`` float32 (float64 for float64 input), zero where
    ``mask`` is False, and metrics: ``entropy``, the mean over valid tokens (detached).
    """
    entropy = entropy.to(torch.promote_types(entropy.dtype, torch.float32))
    zero = torch.zeros((), dtype=entropy.dtype, device=entropy.device)
    loss = -torch.where(mask, entropy, zero)  # masked first: −0 · NaN would stay NaN
    return loss, {"entropy": masked_mean(entropy.detach(), mask).float()}


def linear_token_scores(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    token_ids: Tensor,
    /,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    entropy: bool = False,
    truncation: Truncation | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of the given tokens (and entropies) from hidden states, without the
    ``(n v)`` logits: the vocabulary projection runs inside the chunks.

    z = (h Wᵀ + b) / T,  log π(y | ·) = z_y − logsumexp(z),  H = logsumexp(z) − Σ_v softmax(z)_v z_v,

    computed ``chunk_size`` rows at a time, forward and backward (:class:`_LinearTokenScores`):
    peak memory grows with ``chunk_size · v``, not with ``n · v``. The projection runs in the
    dtype autocast gives it (as the model's own ``lm_head`` would), the softmax in float32
    (float64 for float64 inputs).

    Shapes: ``hidden`` ``(n d)``, ``weight`` ``(v d)``, ``bias`` ``(v)`` or None,
    ``token_ids`` ``(n)`` int64. Returns ``(n)`` log-probs and ``(n)`` entropies (None unless
    ``entropy``), float32 (float64), differentiable through ``hidden``, ``weight`` and
    ``bias`` (once: no second derivative). ``truncation``: the sampler's rule of each token:
    scores of the truncated distribution (module docstring).
    """
    if hidden.dim() != 2 or token_ids.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_token_scores: hidden {tuple(hidden.shape)} and token_ids "
            f"{tuple(token_ids.shape)}; pass (n d) hidden states and (n) token ids"
        )
    if chunk_size < 1:
        raise ValueError(f"linear_token_scores: chunk_size={chunk_size}; use chunk_size >= 1")
    logprobs, ent = _LinearTokenScores.apply(
        hidden, weight, bias, token_ids.long(), temperature, chunk_size, entropy, None, truncation
    )
    return logprobs, ent if entropy else None


def vocab_parallel_token_scores(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    token_ids: Tensor,
    /,
    *,
    group: Any,
    vocab_start: int,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """:func:`linear_token_scores` of an output layer split by vocabulary rows over the ranks of
    ``group`` (tensor parallelism's "loss parallelism"): ``weight`` ``(v/tp d)`` and ``bias``
    are this rank's rows ``[vocab_start, vocab_start + v/tp)``; ``hidden`` ``(n d)`` and
    ``token_ids`` ``(n)`` are the same on every rank. Every rank of ``group`` must call it.

    Each rank computes its logits chunk by chunk, as :func:`linear_token_scores` does, and
    keeps per token only its partial logsumexp ℓ_r, the chosen token's logit where the token is
    its own (0 elsewhere) and, for the entropy, s_r = Σ_{its v} softmax_r(z) z. Then
    lse = logsumexp_r ℓ_r (one all-gather of ``(n)`` per rank), z_y = Σ_r (an all-reduce) and
    Σ_v p z = Σ_r e^{ℓ_r − lse} s_r (an all-reduce): the same numbers as one process up to
    summation order, with ``(n)`` floats per collective, never ``(n v)``. Backward: the local
    logit gradient, with the global lse and H, times the local weight rows, all-reduced over
    ``group`` (each rank holds a part of ∂/∂h); ``weight`` gets its own rows' gradient.

    Returns ``(n)`` log-probs and entropies (None unless ``entropy``), identical on every rank.
    """
    if hidden.dim() != 2 or token_ids.shape != hidden.shape[:1]:
        raise ValueError(
            f"vocab_parallel_token_scores: hidden {tuple(hidden.shape)} and token_ids "
            f"{tuple(token_ids.shape)}; pass (n d) hidden states and (n) token ids"
        )
    if chunk_size < 1:
        raise ValueError(
            f"vocab_parallel_token_scores: chunk_size={chunk_size}; use chunk_size >= 1"
        )
    shard = _VocabShard(group, vocab_start)
    logprobs, ent = _LinearTokenScores.apply(
        hidden, weight, bias, token_ids.long(), temperature, chunk_size, entropy, shard, None
    )
    return logprobs, ent if entropy else None


@dataclass(frozen=True)
class _VocabShard:
    """The process group an output layer's vocabulary rows are split over, and this rank's
    first row."""

    group: Any
    start: int

    def reduce(self, x: Tensor) -> Tensor:
        """Σ over the group's ranks, in place."""
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def logsumexp(self, lse: Tensor) -> Tensor:
        """logsumexp over the ranks of each rank's partial logsumexp."""
        parts = [torch.empty_like(lse) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, lse.contiguous(), group=self.group)
        return torch.logsumexp(torch.stack(parts), dim=0)


class _LinearTokenScores(torch.autograd.Function):
    """Chunked ``z = (h Wᵀ + b) / T`` → log-prob of the chosen token and entropy.

    Gradients per row, with p = softmax(z), g and γ the incoming gradients of the log-prob and
    the entropy:  ∂/∂z_j = g (1[j = y] − p_j) − γ p_j (z_j − lse + H)  (from
    ∂H/∂z_j = −p_j (log p_j + H)); then ∂/∂h = (∂/∂z) W / T, ∂/∂W = (∂/∂z)ᵀ h / T,
    ∂/∂b = Σ_rows ∂/∂z / T. The forward keeps ``hidden``, ``weight``, the ``(n)`` logsumexps
    and entropies; the backward recomputes one chunk of logits at a time. With a
    ``truncation`` rule (never with ``shard``) lse, p and H are those over each token's kept
    set K, p = 0 outside it, so the same formulas hold (module docstring).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        ids: Tensor,
        temperature: float,
        chunk_size: int,
        want_entropy: bool,
        shard: _VocabShard | None,
        truncation: Truncation | None,
    ) -> tuple[Tensor, Tensor]:
        device_type = hidden.device.type
        ctx.autocast = torch.is_autocast_enabled(device_type)
        ctx.autocast_dtype = torch.get_autocast_dtype(device_type)
        n, vocab = hidden.shape[0], weight.shape[0]
        dtype = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        ids = ids - (shard.start if shard is not None else 0)  # this rank's rows
        own = (ids >= 0) & (ids < vocab)
        ids = ids.clamp(0, vocab - 1)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        chosen = torch.empty(n, dtype=dtype, device=hidden.device)
        pz = torch.zeros(n if want_entropy else 0, dtype=dtype, device=hidden.device)
        for start in range(0, n, chunk_size):
            part = slice(start, start + chunk_size)
            z = F.linear(hidden[part], weight, bias).to(dtype) / temperature
            torch.logsumexp(z, dim=-1, out=lse[part])
            chosen[part] = z.gather(-1, ids[part, None])[:, 0]
            if want_entropy:
                pz[part] = (torch.softmax(z, dim=-1) * z).sum(-1)
            cut = _kept(z, ids[part], None if truncation is None else truncation[part])
            if cut is not None:  # over the kept set (0 · −inf: the softmax multiplies z)
                rows, keep = cut
                zk = masked_logits(z[rows], keep)
                lse[part][rows] = torch.logsumexp(zk, dim=-1)
                if want_entropy:
                    pz[part][rows] = (torch.softmax(zk, dim=-1) * z[rows]).sum(-1)
        chosen = torch.where(own, chosen, torch.zeros((), dtype=dtype, device=chosen.device))
        if shard is not None:
            local_lse, lse = lse, shard.logsumexp(lse)
            shard.reduce(chosen)
            if want_entropy:
                pz = shard.reduce(pz * (local_lse - lse).exp())
        out = chosen - lse
        ent = lse - pz if want_entropy else pz
        ctx.save_for_backward(hidden, weight, bias, ids, own, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.want_entropy = temperature, chunk_size, want_entropy
        ctx.shard, ctx.truncation = shard, truncation
        return out, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_lp: Tensor | None, grad_ent: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, ids, own, lse, ent = ctx.saved_tensors
        temperature = ctx.temperature
        device_type = hidden.device.type
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_w = (
            torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if need_w else None
        )
        grad_b = (
            torch.zeros(bias.shape, dtype=accumulate, device=bias.device)
            if need_b and bias is not None
            else None
        )
        use_ent = ctx.want_entropy and grad_ent is not None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            part = slice(start, start + ctx.chunk_size)
            h = hidden[part]
            with torch.autocast(device_type, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
                logits = F.linear(h, weight, bias)
            z = logits.to(lse.dtype) / temperature
            p = (z - lse[part, None]).exp_()
            rule = None if ctx.truncation is None else ctx.truncation[part]
            _zero_outside(p, z, ids[part], rule)
            gz = torch.zeros_like(z)
            if grad_lp is not None:
                g = grad_lp[part].to(lse.dtype)
                g_own = torch.where(own[part], g, torch.zeros((), dtype=g.dtype, device=g.device))
                gz.add_(p * -g[:, None]).scatter_add_(-1, ids[part, None], g_own[:, None])
            if use_ent:
                assert grad_ent is not None  # use_ent says so
                gamma = grad_ent[part].to(lse.dtype)
                shift = z - (lse[part] - ent[part])[:, None]  # z_j − lse + H
                gz.sub_(p * shift * gamma[:, None])
            gz = (gz / temperature).to(logits.dtype)
            if grad_h is not None:
                grad_h[part] = gz @ weight.to(gz.dtype)
            if grad_w is not None:
                grad_w += (gz.T @ h.to(gz.dtype)).to(accumulate)
            if grad_b is not None:
                grad_b += gz.sum(0).to(accumulate)
        if grad_h is not None and ctx.shard is not None:
            ctx.shard.reduce(grad_h)  # each rank's vocabulary rows give part of ∂/∂h
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
            None,
            None,
        )
