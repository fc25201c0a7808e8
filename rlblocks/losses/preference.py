"""Pairwise preference losses (online DPO, IPO, SimPO) and their bridge to the policy trainer.

The rows of a batch form pairs: row ``chosen[p]`` is preferred to row ``rejected[p]``. With
the sequence score (the implicit reward divided by β)

    s_i = Σ_t m_it (log π_θ(y_it) − log π_ref(y_it))     (π_ref dropped without a reference)
    s_i ← s_i / |y_i|,  |y_i| = Σ_t m_it                  (when length-normalized)
    h_p = s_chosen[p] − s_rejected[p]

:func:`preference_loss` gives every pair a loss through one of two links, the logistic
(Bradley–Terry) ``"sigmoid"`` −log σ(β·h − γ) or ``"squared"`` (h − 1/(2β))²; :func:`dpo`,
:func:`ipo` and :func:`simpo` fix the link and the published defaults.

:func:`preference_advantages` turns any such loss into per-token advantages for
``PolicyTrainer.step``, so that online DPO runs on the ordinary policy-gradient trainer with
its micro-batching and data parallelism unchanged:

    A_it = −scale · ∂(Σ_p L_p)/∂log π(y_it)      at the (detached) log-probs of π_old

Why that is exact: the trainer's per-token loss is ℓ_it = −A_it·r_it with
r_it = π_θ(y_it)/π_old(y_it) (clipped, but at θ = θ_old r = 1 and no clip is active), so

    ∇_θ Σ_it ℓ_it = −Σ_it A_it ∇log π_θ(y_it)
                  = scale · Σ_it ∂(Σ_p L_p)/∂log π(y_it) · ∇log π_θ(y_it) = scale · ∇_θ Σ_p L_p

by the chain rule. The trainer divides by the mini-batch normalizer n
(``PolicyTrainer.normalizer``); with ``scale = n / P`` its first step follows exactly ∇ of the
mean pair loss, however the mini-batch is cut into micro-batches or split over ranks, since the
per-token sum is additive. This holds for aggregations that are a plain masked sum over n
(``token_mean``, ``seq_mean_token_sum``, ``seq_mean_token_sum_norm``); ``seq_mean_token_mean``
divides each row by its own length and so re-weights the pairs. It holds at θ_old: later
optimizer steps on the same batch (several mini-batches or epochs) follow PPO's clipped
surrogate of the same advantages, not DPO's gradient at the new θ; keep both members of a pair
in one mini-batch (one mini-batch per step is simplest).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from rlblocks.base.masked import masked_sum
from rlblocks.losses.names import PREFERENCES

PreferenceLoss = Callable[
    [Tensor, Tensor | None, Tensor, Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]
]
"""``(logprobs, ref_logprobs, mask, chosen, rejected) -> (loss (P), metrics)``: a pair loss."""


def preference_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    chosen: Tensor,
    rejected: Tensor,
    /,
    *,
    beta: float = 0.1,
    link: Literal["sigmoid", "squared"] = "sigmoid",
    margin: float = 0.0,
    length_normalized: bool = False,
    reference: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair preference loss L_p for the pairs (chosen[p] ≻ rejected[p]).

    With s_i and h_p as in the module docstring (``reference=False`` drops log π_ref;
    ``length_normalized`` divides by |y_i|, a row with no valid token scoring 0)::

        "sigmoid":  L_p = −log σ(β·h_p − γ)          γ = ``margin``
        "squared":  L_p = (h_p − 1/(2β))²

    "sigmoid" with γ = 0 and a reference is DPO (Rafailov et al. 2023, arXiv 2305.18290,
    eq. 7); without a reference, length-normalized, with γ > 0 it is SimPO (Meng et al. 2024,
    arXiv 2405.14734, eq. 6). "squared" is IPO (Azar et al. 2023, arXiv 2310.12036, eq. 17,
    β = τ). A row may appear in several pairs (its gradient is then the sum).

    Shapes: ``logprobs`` ``(b t)`` (any float dtype, the only input with a gradient),
    ``ref_logprobs`` ``(b t)`` (detached) or None when ``reference=False``, ``mask`` ``(b t)``
    bool, ``chosen`` and ``rejected`` ``(P)`` integer row indices in [0, b). Masked-out
    log-probs may be −inf or NaN: they are replaced before any arithmetic.

    Returns ``loss`` ``(P)`` float32 (float64 for float64 inputs), and metrics, detached float32
    scalars (0 when P = 0): ``preference/loss`` (mean L_p), ``preference/margin`` (mean h_p),
    ``preference/accuracy`` (share of pairs with h_p > 0), ``preference/chosen_reward`` and
    ``preference/rejected_reward`` (mean β·s over the chosen / rejected rows of the pairs).
    """
    _check(logprobs, ref_logprobs, mask, chosen, rejected, beta, link, margin, reference)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    score = torch.where(mask, logprobs.to(dtype), zero)  # (b t), masked before any arithmetic
    if reference and ref_logprobs is not None:  # (_check: not None when reference)
        score = score - torch.where(mask, ref_logprobs.detach().to(dtype), zero)
    seq = masked_sum(score, mask, dim=-1)  # s_i (b)
    if length_normalized:
        seq = seq / mask.sum(dim=-1).clamp(min=1).to(dtype)
    h = seq[chosen] - seq[rejected]  # (P)
    if link == "sigmoid":
        loss = -F.logsigmoid(beta * h - margin)
    else:
        loss = (h - 1.0 / (2.0 * beta)).square()
    with torch.no_grad():
        metrics = {
            "preference/loss": _mean(loss),
            "preference/margin": _mean(h),
            "preference/accuracy": _mean(h > 0),
            "preference/chosen_reward": _mean(beta * seq[chosen]),
            "preference/rejected_reward": _mean(beta * seq[rejected]),
        }
    return loss, metrics


@PREFERENCES.register("dpo")
def dpo(
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    chosen: Tensor,
    rejected: Tensor,
    /,
    *,
    beta: float = 0.1,
    margin: float = 0.0,
    length_normalized: bool = False,
    reference: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO: L_p = −log σ(β·(s_chosen − s_rejected)), s = Σ_t (log π_θ − log π_ref).

    Rafailov et al. 2023, arXiv 2305.18290, eq. 7; β = 0.1 is their and TRL's default.
    :func:`preference_loss` with ``link="sigmoid"`` (its other keywords and defaults
    unchanged); shapes and metrics as there.
    """
    return preference_loss(
        logprobs,
        ref_logprobs,
        mask,
        chosen,
        rejected,
        beta=beta,
        link="sigmoid",
        margin=margin,
        length_normalized=length_normalized,
        reference=reference,
    )


@PREFERENCES.register("ipo")
def ipo(
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    chosen: Tensor,
    rejected: Tensor,
    /,
    *,
    beta: float = 0.1,
    length_normalized: bool = True,
    reference: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """IPO: L_p = (h_p − 1/(2β))², with s = mean_t (log π_θ − log π_ref) length-normalized.

    Azar et al. 2023, arXiv 2310.12036, eq. 17 (their τ is β). The paper writes h with
    sequence log-probabilities; like TRL's ``DPOTrainer`` (``loss_type="ipo"``) we divide each
    s_i by |y_i| by default: summed log-ratios grow with length, so a fixed target 1/(2β) would
    mean a different regularization for every length, and TRL reports that the IPO authors
    confirmed the normalized form is what the paper's results used. ``length_normalized=False``
    gives eq. 17 literally. :func:`preference_loss` with ``link="squared"``; shapes and metrics
    as there.
    """
    return preference_loss(
        logprobs,
        ref_logprobs,
        mask,
        chosen,
        rejected,
        beta=beta,
        link="squared",
        length_normalized=length_normalized,
        reference=reference,
    )


@PREFERENCES.register("simpo")
def simpo(
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    chosen: Tensor,
    rejected: Tensor,
    /,
    *,
    beta: float = 2.0,
    margin: float = 1.0,
    length_normalized: bool = True,
    reference: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SimPO: L_p = −log σ(β·(s_chosen − s_rejected) − γ), s = mean_t log π_θ, no reference.

    Meng et al. 2024, arXiv 2405.14734, eq. 6; γ = ``margin`` is the target reward margin, in
    the units of β·s. Defaults β = 2.0, γ = 1.0: the paper's β for its base models and the
    γ/β = 0.5 its authors' repository (princeton-nlp/SimPO) recommends as a starting point (it
    tunes γ/β in [0, 1]; pass ``margin=ratio * beta`` when changing β). ``ref_logprobs`` may
    be None. :func:`preference_loss` with ``link="sigmoid"``; shapes and metrics as there.
    """
    return preference_loss(
        logprobs,
        ref_logprobs,
        mask,
        chosen,
        rejected,
        beta=beta,
        link="sigmoid",
        margin=margin,
        length_normalized=length_normalized,
        reference=reference,
    )


def uses_reference(loss_fn: PreferenceLoss) -> bool:
    """Whether ``loss_fn`` (:func:`dpo`, :func:`ipo`, :func:`simpo`, or a ``partial`` of one)
    reads π_ref: its ``reference`` default, as a ``partial`` may have bound it. A recipe scores
    ``ref_logprobs``, and a trainer keeps a reference model, only when it does."""
    return bool(inspect.signature(loss_fn).parameters["reference"].default)


def preference_advantages(
    loss_fn: PreferenceLoss,
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    chosen: Tensor,
    rejected: Tensor,
    /,
    *,
    scale: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token advantages A = −scale · ∂(Σ_p L_p)/∂logprobs, at the given log-probs.

    The bridge from a pair loss to ``PolicyTrainer.step`` (why it is exact, and for which
    aggregations: module docstring). Pass ``logprobs`` of π_old, the policy the trainer starts
    from, and ``scale = normalizer / P`` (the trainer's mini-batch normalizer) to make the
    step's gradient ∇ of the mean pair loss. The gradient is taken by autograd in float64 on a
    detached copy; nothing flows back into ``logprobs``. Works under ``torch.no_grad``.

    ``loss_fn``: a :data:`PreferenceLoss` such as :func:`dpo`, :func:`ipo`, :func:`simpo` or a
    ``partial`` of :func:`preference_loss`. Shapes as in :func:`preference_loss`.

    Returns ``advantages`` ``(b t)`` float32, 0 where ``mask`` is False and on rows in no pair,
    detached, and the loss's metrics (float32).
    """
    with torch.enable_grad():
        leaf = logprobs.detach().to(torch.float64).requires_grad_(True)
        ref = None if ref_logprobs is None else ref_logprobs.detach().to(torch.float64)
        loss, metrics = loss_fn(leaf, ref, mask, chosen, rejected)
        (grad,) = torch.autograd.grad(loss.sum(), leaf, allow_unused=True)
    if grad is None:  # no pair: the loss does not depend on any log-prob
        grad = torch.zeros_like(leaf)
    advantages = torch.where(mask, -scale * grad, grad.new_zeros(()))
    return advantages.float(), {k: v.detach().float() for k, v in metrics.items()}


def ranked_pairs(rewards: Tensor, group_ids: Tensor, /) -> tuple[Tensor, Tensor]:
    """One (chosen, rejected) pair per group: its highest- and lowest-rewarded rows.

    The pairs of online DPO (two samples per prompt: the better and the worse; with more
    samples, best against worst). A group whose rewards are all equal, or that has one row,
    gives no pair: a tie carries no preference. Among equal best (worst) rewards the first
    (last) row is taken. ``rewards`` ``(b)`` float, ``group_ids`` ``(b)`` int; returns two
    ``(P)`` int64 row-index tensors, groups in order of first appearance.
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"ranked_pairs: rewards {tuple(rewards.shape)} and group_ids "
            f"{tuple(group_ids.shape)} must both be (b); pass one reward and one group id per row"
        )
    chosen, rejected = [], []
    for gid in dict.fromkeys(group_ids.tolist()):
        rows = torch.nonzero(group_ids == gid).flatten()
        r = rewards[rows]
        best, worst = int(torch.argmax(r)), len(r) - 1 - int(torch.argmin(r.flip(0)))
        if r[best] > r[worst]:
            chosen.append(int(rows[best]))
            rejected.append(int(rows[worst]))
    as_index = partial(torch.tensor, dtype=torch.long, device=rewards.device)
    return as_index(chosen), as_index(rejected)


# ---------------------------------------------------------------------------------------------


def _mean(values: Tensor) -> Tensor:
    """Mean as a float32 scalar; 0 (not NaN) for an empty tensor."""
    return values.float().sum() / max(values.numel(), 1)


def _check(
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    chosen: Tensor,
    rejected: Tensor,
    beta: float,
    link: str,
    margin: float,
    reference: bool,
) -> None:
    """Raise a readable error on wrong hyperparameters, shapes, dtypes or pair indices."""
    if not beta > 0:
        raise ValueError(f"preference_loss: beta must be > 0, got {beta}; pass a positive beta")
    if link not in ("sigmoid", "squared"):
        raise ValueError(
            f"preference_loss: link must be 'sigmoid' or 'squared', got {link!r}; pass one of them"
        )
    if link == "squared" and margin != 0.0:
        raise ValueError(
            f"preference_loss: margin applies to link='sigmoid' only, got margin={margin} with "
            "'squared'; pass margin=0.0, or link='sigmoid'"
        )
    if mask.dtype != torch.bool:
        raise TypeError(
            f"preference_loss: mask must be bool (True = token counts), got {mask.dtype}; "
            "convert with .bool()"
        )
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(
            f"preference_loss: logprobs and mask must be (b t) of one shape, got "
            f"{tuple(logprobs.shape)} and {tuple(mask.shape)}; pass them from one batch"
        )
    if reference and ref_logprobs is None:
        raise ValueError(
            "preference_loss: ref_logprobs is None but reference=True; pass π_ref's log-probs (b t)"
        )
    if reference and ref_logprobs is not None and ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"preference_loss: ref_logprobs has shape {tuple(ref_logprobs.shape)}, "
            f"expected {tuple(logprobs.shape)} (b t); score the same batch with the reference"
        )
    for name, index in (("chosen", chosen), ("rejected", rejected)):
        if index.dim() != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
            raise ValueError(
                f"preference_loss: {name} must be a 1-D integer tensor of row indices, got "
                f"shape {tuple(index.shape)} and dtype {index.dtype}; pass int64 row indices"
            )
    if chosen.shape != rejected.shape:
        raise ValueError(
            f"preference_loss: chosen and rejected must pair up, got {chosen.numel()} chosen vs "
            f"{rejected.numel()} rejected indices; pass one rejected row per chosen row"
        )
    b = logprobs.shape[0]
    for name, index in (("chosen", chosen), ("rejected", rejected)):
        bad = ((index < 0) | (index >= b)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"preference_loss: {name}[{bad[0]}] = {int(index[bad[0]])} is not a row of the "
                f"batch [0, {b}); pass row indices in 0..{b - 1}"
            )
    same = (chosen == rejected).nonzero().flatten().tolist()
    if same:
        raise ValueError(
            f"preference_loss: pair {same[0]}: row {int(chosen[same[0]])} is both chosen and "
            "rejected; pair each chosen row with a different rejected row"
        )
