"""Inputs and references shared by the policy-loss tests in ``tests/losses``.

A plain module, not a test file: ``pythonpath = ["tests"]`` in pyproject.toml puts ``tests`` on
``sys.path``, so the test modules import it with ``from loss_cases import ...`` under
``--import-mode=importlib``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.losses.gpg import gpg_loss

NAN, INF = float("nan"), float("inf")


def leaf(x: Tensor) -> Tensor:
    """A fresh leaf copy of ``x`` that collects a gradient."""
    return x.detach().clone().requires_grad_(True)


def random_batch(
    seed: int, *, b: int = 6, t: int = 7, spread: float = 0.5, row_advantage: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random ``(logprobs, old_logprobs, advantages, mask)``, each ``(b t)``.

    Row 0 has exactly one valid token (position 3), row 1 none; the other rows keep each token
    with probability 0.7. Masked entries are poisoned: logprobs and advantages NaN, old
    logprobs -inf, so any leak of a masked position shows up. ``old_logprobs`` lie in
    [-3.05, -0.05]; ``logprobs = old + spread·N(0, 1)``, so ``spread`` sets how far the ratios
    are from 1. ``row_advantage`` draws one advantage per row (sequence-level rewards, as GSPO
    uses) instead of one per token. The same seed gives the same tensors on every call.
    """
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3 - 0.05
    lp = old + spread * torch.randn(b, t, generator=g)
    if row_advantage:
        adv = torch.randn(b, 1, generator=g).expand(b, t)
    else:
        adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0] = False
    mask[0, 3] = True
    mask[1] = False
    lp = torch.where(mask, lp, NAN)
    old = torch.where(mask, old, -INF)
    adv = torch.where(mask, adv, NAN)
    return lp, old, adv, mask


def policy_gradient(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """The plain policy-gradient reference ``-A·log π``: its per-token loss and d loss / d logp.

    Computed with ``gpg_loss`` on a fresh leaf copy of ``logprobs``; both outputs are ``(b t)``.
    """
    x = leaf(logprobs)
    loss, _ = gpg_loss(x, old_logprobs, advantages, mask)
    loss.sum().backward()
    return loss.detach(), x.grad
