"""Critic loss for PPO: squared error to the returns, optionally with value clipping."""

from __future__ import annotations

import torch
from torch import Tensor

from rlblocks.base.masked import masked_mean, masked_var


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    /,
    *,
    clip: float | None = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token (clipped) value loss.

    With ε = ``clip`` (value clipping of the OpenAI baselines PPO2 implementation, also verl's
    ``compute_value_loss`` and TRL; Schulman et al. 2017, arXiv 1707.06347, eq. 9 gives the
    unclipped (V − R)² term):

        V_clip = clip(V, V_old − ε, V_old + ε)
        L_t    = ½ · max((V − R)², (V_clip − R)²)

    and with ``clip=None`` plainly L_t = ½ (V − R)². Taking the max makes the clipped loss
    pessimistic: once V has moved more than ε away from V_old in the direction that lowers the
    error, that token stops pulling it further (its gradient is zero). Note that the clip is in
    absolute units of the returns, so ε must match their scale.

    Shapes: ``values`` ``(b t)`` (gradient flows through it), ``old_values`` ``(b t)`` (the
    critic's values at rollout time) and ``returns`` ``(b t)`` (both detached), ``mask``
    ``(b t)`` bool. Returns the loss ``(b t)`` float32 (float64 for float64 values), zero where
    ``mask`` is False, and detached metrics over valid tokens:

    - ``vf_clip_frac``: fraction of tokens where the clipped term is the larger one (where
      clipping changes the loss); 0 with ``clip=None``;
    - ``vf_explained_var``: 1 − Var(R − V) / Var(R) (1 is a perfect critic, 0 no better than
      the mean return, negative worse); NaN when the returns are constant, where it is
      undefined (as in Stable-Baselines3);
    - ``values_mean``: the mean of V.
    """
    dtype = torch.promote_types(values.dtype, torch.float32)
    # Mask the inputs first, so that NaN/inf at masked-out tokens cannot reach the gradient.
    zero = torch.zeros((), dtype=dtype, device=values.device)
    values = torch.where(mask, values.to(dtype), zero)
    old_values = torch.where(mask, old_values.detach().to(dtype), zero)
    returns = torch.where(mask, returns.detach().to(dtype), zero)
    unclipped = (values - returns).square()
    if clip is None:
        per_token = unclipped
        clipped_wins = torch.zeros_like(mask)
    else:
        values_clipped = torch.clamp(values, old_values - clip, old_values + clip)
        clipped = (values_clipped - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        clipped_wins = clipped > unclipped
    loss = torch.where(mask, 0.5 * per_token, zero)
    metrics = {
        "vf_clip_frac": masked_mean(clipped_wins.float(), mask),
        "vf_explained_var": _explained_variance(values.detach(), returns, mask),
        "values_mean": masked_mean(values.detach(), mask),
    }
    return loss, metrics


def _explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    # 1 − Var(R − V) / Var(R) over valid tokens; NaN where Var(R) = 0.
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    ratio = var_residual / torch.where(var_returns > 0, var_returns, 1.0)
    nan = torch.full((), float("nan"), dtype=ratio.dtype, device=ratio.device)
    return torch.where(var_returns > 0, 1.0 - ratio, nan).float()
