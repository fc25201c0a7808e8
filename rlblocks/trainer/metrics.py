"""Accumulating the metrics of one ``PolicyTrainer.step`` without a host sync per micro-batch.

Loss metrics are averaged over micro-batches weighted by their number of valid tokens; the loss
is summed over the micro-batches of a mini-batch (that sum *is* the mini-batch loss, thanks to
the shared normalizer) and averaged over optimizer steps. A mini-batch is first held as
pending and only added to the totals when its optimizer step is applied: the metrics of a step
skipped by the NaN guard are dropped (they would be NaN), and ``skipped_steps`` reports it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor


class StepMetrics:
    """Running sums of the metrics of one ``step`` call; :meth:`summary` turns them into floats."""

    def __init__(self) -> None:
        self._sums: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        self._tokens = torch.zeros((), dtype=torch.float64)
        self._pending: list[tuple[dict[str, Tensor], Tensor]] = []
        self._pending_loss = torch.zeros((), dtype=torch.float64)
        self._losses: list[Tensor] = []
        self._grad_norms: list[Tensor] = []

    def add_micro_batch(self, loss: Tensor, metrics: dict[str, Tensor], *, tokens: Tensor) -> None:
        """One micro-batch: its aggregated loss, its metrics (means over its tokens), tokens."""
        values = {k: torch.as_tensor(v).detach().double() for k, v in metrics.items()}
        self._pending.append((values, tokens.double()))
        self._pending_loss = self._pending_loss + loss.detach().double()

    def commit(self, grad_norm: Tensor | None) -> None:
        """The pending mini-batch's optimizer step was applied: count its metrics (and its
        gradient norm; None for a ``forward_backward`` call, whose step is still to come)."""
        for values, tokens in self._pending:
            for key, value in values.items():
                self._sums[key] = self._sums[key] + value * tokens
            self._tokens = self._tokens + tokens
        self._losses.append(self._pending_loss)
        if grad_norm is not None:
            self._grad_norms.append(grad_norm.detach().double())
        self.discard()

    def discard(self) -> None:
        """The pending mini-batch's step was skipped: forget its metrics."""
        self._pending = []
        self._pending_loss = torch.zeros((), dtype=torch.float64)

    def summary(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
        """Token-weighted loss metrics, mean loss and mean pre-clipping grad norm (NaN if none).

        ``reduce``: a sum over data-parallel ranks (``DataParallel.all_sum``), applied to the
        token-weighted sums, the token count and each mini-batch's loss (the ranks' shares of
        a mini-batch loss add up to it). Every rank must hold the same metric names.
        """
        keys = sorted(self._sums)
        if reduce is not None:
            flat = torch.stack([self._sums[k] for k in keys] + [self._tokens, *self._losses])
            flat = reduce(flat)
            self._sums = dict(zip(keys, flat[: len(keys)], strict=True))
            self._tokens = flat[len(keys)]
            self._losses = list(flat[len(keys) + 1 :])
        # One transfer for every number (on a GPU each float() would wait for the device).
        means = [_mean_tensor(self._losses), _mean_tensor(self._grad_norms)]
        parts = [torch.as_tensor(self._tokens, dtype=torch.float64).reshape(1)]
        parts += [self._sums[k].double().reshape(1).to(parts[0].device) for k in keys]
        parts += [m.to(parts[0].device).reshape(1) for m in means]
        tokens, *values = torch.cat(parts).tolist()
        out = {
            k: v / tokens if tokens > 0 else math.nan for k, v in zip(keys, values, strict=False)
        }
        out["loss"], out["grad_norm"] = values[len(keys)], values[len(keys) + 1]
        return out


def _mean_tensor(values: list[Tensor]) -> Tensor:
    """The mean of ``values`` as a float64 scalar tensor; NaN when there is none."""
    if not values:
        return torch.tensor(math.nan, dtype=torch.float64)
    return torch.stack([v.double().to(values[0].device) for v in values]).mean()
