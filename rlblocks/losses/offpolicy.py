"""Off-policy corrections: importance weights for rows sampled by another policy than π_old.

The engine samples y ~ π_rollout: other kernels or dtypes than the trainer's, weights one or
more updates older in an asynchronous run (`rlblocks.run.RunOptions.staleness`). The update
assumes samples from π_old, the trainer's policy before the update, so each of these wraps a
policy loss and passes it per-token importance weights ``is_weights`` built from the ratio

    r_t = π_old(y_t) / π_rollout(y_t) = exp(old_logprobs − rollout_logprobs),   detached,

at one of three levels (``level=``):

- ``"token"``: r_t itself;
- ``"sequence"``: the response's ratio ρ = Π_t r_t, the same for every token of the row (the
  exact importance weight of the whole response; its variance grows with the length);
- ``"geometric"``: the per-token geometric mean exp(mean_t log r_t), the same for every token
  of the row (length-normalised, as GSPO normalises its ratio).

and one of two treatments of large ratios:

- :class:`TruncatedIS`: w = min(r, cap) (Yao et al. 2025, "Your efficient RL framework
  secretly brings you off-policy RL training", blog post; Espeholt et al. 2018, IMPALA,
  arXiv 1802.01561, truncates the same way);
- :class:`MaskedIS`: w = r inside [low, high], 0 outside: a token (or a whole response) whose
  ratio left the band gives no gradient at all. IcePop (Ling team 2025, "Every step evolves",
  arXiv 2510.18855) masks tokens outside [1/2, 2]; masked importance sampling (MIS: Yao et
  al.'s follow-up "When speed kills stability", blog post, 2025) is ``low=0, high=C``.

They correct anything that separates the sampler from π_old, and only that: π_old must be the
trainer's own log-probs (``RunOptions(old_logprobs="recompute")``, or ``"auto"`` with an
engine of its own), not the engine's, or r is 1 everywhere and the correction does nothing.
The PPO ratio π_θ / π_old inside the wrapped loss then stays a proximal-policy ratio (the
"decoupled" PPO objective of Hilton et al. 2022, arXiv 2110.00641, and of AReaL).

A correction needs ``rollout_logprobs``: the trainer refuses, naming the loss, rollouts without
them. Metrics: ``tis/weight_mean`` and ``tis/capped_frac`` (share of tokens at the cap);
``mis/weight_mean`` and ``mis/masked_frac`` (share of tokens masked); over valid tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from rlblocks.base.registry import Registry
from rlblocks.interfaces import PolicyLoss
from rlblocks.losses.inputs import forwarding_signature, loss_inputs

Level = Literal["token", "sequence", "geometric"]
LEVELS = ("token", "sequence", "geometric")

#: |log ρ| beyond this is clamped before ``exp`` (float64: e^±80 is finite, and far past any
#: cap or band a correction applies).
LOG_RATIO_CLAMP = 80.0


def importance_ratios(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, level: Level = "token"
) -> Tensor:
    """Per-token importance ratios π_old / π_rollout at ``level`` (module docstring), ``(b t)``
    float64, detached; 1 where ``mask`` is False. A row with no valid token has ratio 1."""
    if level not in LEVELS:
        raise ValueError(f"importance_ratios: level={level!r}; use one of {LEVELS}")
    d = old_logprobs.detach().double() - rollout_logprobs.detach().double()
    d = torch.where(mask, d, torch.zeros((), dtype=d.dtype, device=d.device))
    if level == "sequence":
        d = d.sum(-1, keepdim=True).expand_as(d)
    elif level == "geometric":
        count = mask.sum(-1, keepdim=True).clamp(min=1)
        d = (d.sum(-1, keepdim=True) / count).expand_as(d)
    ratio = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    return torch.where(mask, ratio, torch.ones_like(ratio))


@dataclass(frozen=True)
class OffPolicyCorrection:
    """What the corrections share: the inner loss, the level, the forwarding signature (a
    recipe's ``RunOptions.correction="auto"`` leaves a loss that already is one as it is)."""

    loss_fn: PolicyLoss

    def __post_init__(self) -> None:
        level = getattr(self, "level", "token")
        if level not in LEVELS:
            raise ValueError(
                f"{type(self).__name__}: level={level!r} is not a level; use one of {LEVELS}"
            )
        # What the trainer reads: rollout_logprobs and what loss_fn takes, not all that
        # **kwargs could hold (else it would score the reference and the entropy for nothing).
        signature = forwarding_signature(self.loss_fn, required=["rollout_logprobs"])
        object.__setattr__(self, "__signature__", signature)

    def _weights(self, ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``(weights, flagged)``: the weights from the ratios, and which tokens were capped or
        masked."""
        raise NotImplementedError

    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        /,
        *,
        rollout_logprobs: Tensor,
        **kwargs: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        level: Level = getattr(self, "level", "token")
        ratio = importance_ratios(old_logprobs, rollout_logprobs, mask, level=level)
        weights, flagged = self._weights(ratio, mask)
        weights = torch.where(mask, weights, torch.ones_like(weights)).float()
        accepted = loss_inputs(self.loss_fn).accepted
        passed = {k: v for k, v in kwargs.items() if k in accepted}
        if "rollout_logprobs" in accepted:
            passed["rollout_logprobs"] = rollout_logprobs
        loss, metrics = self.loss_fn(
            logprobs, old_logprobs, advantages, mask, is_weights=weights, **passed
        )
        valid = mask.sum().clamp(min=1)
        prefix, flag = self._names
        metrics = {
            **metrics,
            f"{prefix}/weight_mean": (weights * mask).sum() / valid,
            f"{prefix}/{flag}": (flagged & mask).sum() / valid,
        }
        return loss, metrics

    _names: ClassVar[tuple[str, str]] = ("", "")
    """(metric prefix, name of the share of flagged tokens)."""


@dataclass(frozen=True)
class TruncatedIS(OffPolicyCorrection):
    """A policy loss whose per-token terms are weighted by min(r, ``cap``), r the importance
    ratio π_old / π_rollout at ``level`` (module docstring).

    ``TruncatedIS(partial(clipped_surrogate, clip=(0.2, 0.28)), cap=2.0)`` is a loss like any
    other; the trainer hands it ``rollout_logprobs`` (required) and it passes the inner loss
    ``is_weights`` plus whichever of ``ref_logprobs`` / ``entropy`` the inner loss takes (its
    signature names just those, so the trainer computes nothing else). Metrics add
    ``tis/weight_mean`` and ``tis/capped_frac`` (share of tokens at the cap).
    """

    cap: float = 2.0
    level: Level = "token"
    _names: ClassVar[tuple[str, str]] = ("tis", "capped_frac")

    def __post_init__(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"TruncatedIS: cap must be > 0, got {self.cap}; pass a positive cap")
        super().__post_init__()

    def _weights(self, ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return ratio.clamp(max=self.cap), ratio >= self.cap


@dataclass(frozen=True)
class MaskedIS(OffPolicyCorrection):
    """A policy loss whose per-token terms are weighted by r inside [``low``, ``high``] and by
    0 outside it, r the importance ratio π_old / π_rollout at ``level`` (module docstring):
    IcePop's token masking with the defaults, masked importance sampling (MIS) with ``low=0``.

    ``reweight=False`` keeps the weight 1 inside the band (masking only, no reweighting). Used
    like `TruncatedIS`. Metrics add ``mis/weight_mean`` and ``mis/masked_frac`` (share of
    tokens masked).
    """

    low: float = 0.5
    high: float = 2.0
    level: Level = "token"
    reweight: bool = True
    _names: ClassVar[tuple[str, str]] = ("mis", "masked_frac")

    def __post_init__(self) -> None:
        if not 0 <= self.low < 1 < self.high:
            raise ValueError(
                f"MaskedIS: the band [{self.low}, {self.high}] must hold 1 with 0 <= low; pass "
                "e.g. low=0.5, high=2.0 (IcePop) or low=0, high=2.0 (MIS)"
            )
        super().__post_init__()

    def _weights(self, ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        outside = (ratio < self.low) | (ratio > self.high)
        kept = ratio if self.reweight else torch.ones_like(ratio)
        return torch.where(outside, torch.zeros_like(ratio), kept), outside


#: What ``RunOptions(correction="auto")`` wraps a recipe's policy loss in when it trains on
#: stale rows with π_old recomputed: IcePop's token mask (docs/run.md says why).
ASYNC_DEFAULT = partial(MaskedIS, low=0.5, high=2.0)


class Correction(NamedTuple):
    """A ``correction`` by name (the YAML key): what it does, where π_old comes from
    (`rlblocks.run.RunOptions.old_logprobs`) and the block that wraps the loss (None: none)."""

    does: str
    old_logprobs: Literal["auto", "recompute", "rollout"]
    correction: Any


#: ``correction``: the blocks above by name, applied by the recipe (`RunOptions.correction`).
#: Each needs π_old recomputed by the trainer (its ratio is π_old against the engine's
#: log-probs), except ``rollout``, where π_old *is* the engine's and the PPO clip alone bounds
#: the ratio to the sampling weights. For config files and command lines only.
CORRECTIONS: Registry[Correction] = Registry("off-policy correction", key="correction")
CORRECTIONS.register(
    "rollout", Correction("pi_old = the engine's log-probs, clipped by PPO", "rollout", None)
)
CORRECTIONS.register(
    "none", Correction("pi_old recomputed, no importance weight", "recompute", None)
)
CORRECTIONS.register(
    "tis",
    Correction(
        "pi_old recomputed, tokens weighted by min(pi_old / pi_rollout, 2)",
        "auto",
        partial(TruncatedIS, cap=2.0),
    ),
)
CORRECTIONS.register(
    "icepop",
    Correction(
        "pi_old recomputed, tokens with pi_old / pi_rollout outside [1/2, 2] masked",
        "auto",
        ASYNC_DEFAULT,
    ),
)
CORRECTIONS.register(
    "seq-mask",
    Correction(
        "pi_old recomputed, responses with a geometric-mean ratio outside [1/2, 2] masked",
        "auto",
        partial(MaskedIS, low=0.5, high=2.0, level="geometric"),
    ),
)
#: The correction a k-steps-off run gets when none is named: RunOptions' own default.
DEFAULT_CORRECTION = "icepop"


__all__ = [
    "ASYNC_DEFAULT",
    "CORRECTIONS",
    "DEFAULT_CORRECTION",
    "LEVELS",
    "Correction",
    "Level",
    "MaskedIS",
    "OffPolicyCorrection",
    "TruncatedIS",
    "importance_ratios",
]
