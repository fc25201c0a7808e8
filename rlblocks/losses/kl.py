"""KL divergence to a reference policy: per-token estimators, a KL loss, a KL reward penalty.

Every estimator estimates KL(π_θ ‖ π_ref) from a token sampled from the current policy π_θ,
using only the two log-probabilities of that token (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html). With log r = log π_ref − log π_θ:

    k1 = −log r                  unbiased, high variance, can be negative
    k2 = ½ (log r)²              biased, low variance, ≥ 0
    k3 = (r − 1) − log r         unbiased, low variance, ≥ 0
    kl_abs = |log r|             biased, ≥ 0

An estimator is any ``(logprobs, ref_logprobs) -> (b t)`` callable; variants are partials
(``low_var_kl = partial(k3, clamp=10.0)``, verl's name for its clamped k3).

There are two ways to use them, and they are not interchangeable:

- :func:`kl_loss` adds β·k to the loss (GRPO, Shao et al. 2024, arXiv 2402.03300, eqs. 3–4):
  the gradient flows through ``logprobs``; :func:`kl_regularized` adds it to any policy loss.
- :func:`kl_penalty_rewards` subtracts β·k from the reward (Ziegler et al. 2019, arXiv
  1909.08593, sec. 2.2; InstructGPT, Ouyang et al. 2022, arXiv 2203.02155, sec. 3.5): the
  penalty is a detached number and reaches the policy through the advantage estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from rlblocks.base.masked import masked_mean, masked_sum
from rlblocks.interfaces import PolicyLoss
from rlblocks.losses.inputs import forwarding_signature, loss_inputs

KLEstimator = Callable[[Tensor, Tensor], Tensor]
"""``(logprobs, ref_logprobs) -> kl``, all ``(b t)``; the per-token estimate of KL(π_θ ‖ π_ref)."""


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    # log r = log π_ref − log π_θ, in float32 (or wider) whatever the input dtype.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    return ref_logprobs.to(dtype) - logprobs.to(dtype)


def k1(logprobs: Tensor, ref_logprobs: Tensor, /) -> Tensor:
    """k1 = −log r = log π_θ(y) − log π_ref(y): the naive, unbiased KL estimator.

    Schulman 2020 (http://joschu.net/blog/kl-approx.html). E_{y∼π_θ}[k1] = KL(π_θ ‖ π_ref)
    exactly, but single samples are negative half of the time and the variance is high.

    Shapes: ``logprobs``, ``ref_logprobs`` ``(b t)``; returns ``(b t)`` float32 (float64 for
    float64 inputs). Not masked, not detached: the caller decides.
    """
    return -_log_ratio(logprobs, ref_logprobs)


def k2(logprobs: Tensor, ref_logprobs: Tensor, /) -> Tensor:
    """k2 = ½ (log r)²: biased but low-variance, never negative.

    Schulman 2020 (http://joschu.net/blog/kl-approx.html): its bias is third order in
    log r, so it is accurate when the policies are close. Its gradient through ``logprobs``,
    (log π_θ − log π_ref)·∇log π_θ, is the on-policy score-function gradient of
    KL(π_θ ‖ π_ref) for a single token.

    Shapes: ``(b t)`` in, ``(b t)`` float32 out. Not masked, not detached.
    """
    return 0.5 * _log_ratio(logprobs, ref_logprobs).square()


def k3(logprobs: Tensor, ref_logprobs: Tensor, /, *, clamp: float | None = None) -> Tensor:
    """k3 = (r − 1) − log r, r = π_ref(y)/π_θ(y): unbiased, low variance, never negative.

    Schulman 2020 (http://joschu.net/blog/kl-approx.html): k1 plus the control variate
    r − 1 (whose expectation under π_θ is 0); x − 1 ≥ log x makes every sample ≥ 0.
    ``r − 1`` is computed as ``expm1(log r)`` so that it keeps its precision near r = 1.

    ``clamp`` reproduces verl's ``low_var_kl``: log r is first clamped to [−20, 20] (so that
    exp cannot overflow) and the result to [−clamp, clamp] (verl uses 10). Clamped tokens get
    no gradient.

    Shapes: ``(b t)`` in, ``(b t)`` float32 out. Not masked, not detached.
    """
    log_r = _log_ratio(logprobs, ref_logprobs)
    if clamp is not None:
        log_r = log_r.clamp(-20.0, 20.0)
    kl = torch.expm1(log_r) - log_r
    return kl if clamp is None else kl.clamp(-clamp, clamp)


low_var_kl: KLEstimator = partial(k3, clamp=10.0)
"""verl's ``low_var_kl``: k3 with log r clamped to [−20, 20] and the estimate to [−10, 10]."""


def kl_abs(logprobs: Tensor, ref_logprobs: Tensor, /) -> Tensor:
    """kl_abs = |log r| = |log π_θ(y) − log π_ref(y)|: the absolute log-ratio (biased, ≥ 0).

    The "abs" penalty of TRL and verl; Schulman 2020 for the family. Shapes: ``(b t)`` in,
    ``(b t)`` float32 out. Not masked, not detached.
    """
    return _log_ratio(logprobs, ref_logprobs).abs()


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    /,
    *,
    estimator: KLEstimator = k3,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token KL loss L_t = k(log π_θ(y_t), log π_ref(y_t)), to be added with a coefficient β.

    GRPO (Shao et al. 2024, arXiv 2402.03300, eqs. 3–4) adds β·k3 to the per-token loss. The
    gradient flows through ``logprobs``; ``ref_logprobs`` is detached.

    Beware the gradient (Tang & Munos 2025, "On a few pitfalls in KL divergence gradient
    estimation for RL", arXiv 2506.09477). With y ∼ π_θ held fixed,

    - k3: ∇k3 = (1 − r)·∇log π_θ, whose expectation is −Σ_y π_ref(y)∇log π_θ(y)
      = ∇ KL(π_ref ‖ π_θ): the gradient of the *forward* KL, not of the reverse
      KL(π_θ ‖ π_ref) that k3 estimates in value. The two agree only to first order near
      π_θ = π_ref.
    - k1: ∇k1 = ∇log π_θ has expectation 0: as a loss it adds noise and no signal.
    - k2: ∇k2 = (log π_θ − log π_ref)·∇log π_θ is the on-policy gradient of the reverse KL
      at this token.

    Summed over a sequence, the per-token terms also drop the effect of each token on the
    distribution of later tokens, so none is the exact gradient of the sequence-level KL; to
    get that, put the KL in the reward with :func:`kl_penalty_rewards` (which uses k1).

    Shapes: ``logprobs``, ``ref_logprobs`` ``(b t)`` float, ``mask`` ``(b t)`` bool.
    Returns the loss ``(b t)`` float32, zero where ``mask`` is False, and metrics (detached
    float32 scalars): ``kl`` the mean estimate over valid tokens.
    """
    # Mask the inputs before any arithmetic: masked-out log-probs may be −inf or NaN, and a
    # NaN reaching the estimator would give NaN gradients even behind a final where.
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    kl = estimator(
        torch.where(mask, logprobs, zero), torch.where(mask, ref_logprobs.detach(), zero)
    )
    loss = torch.where(mask, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    metrics = {"kl": masked_mean(kl.detach(), mask).float()}
    return loss, metrics


def kl_regularized(
    loss_fn: PolicyLoss, *, kl_coef: float, estimator: KLEstimator = k3
) -> PolicyLoss:
    """``loss_fn`` plus a KL loss term: ℓ_t = ℓ^policy_t + β · k(log π_θ(y_t), log π_ref(y_t)).

    The KL-as-loss form of GRPO (Shao et al. 2024, arXiv 2402.03300, eq. 3) with the per-token
    :func:`kl_loss` (see its docstring for what each estimator's gradient is). β = ``kl_coef``.
    The returned loss follows the ``PolicyLoss`` protocol: ``(logprobs, old_logprobs,
    advantages, mask, /, *, ref_logprobs, ...) -> (loss (b t), metrics)``; it requires
    ``ref_logprobs`` ``(b t)`` (detached) and forwards ``entropy`` / ``rollout_logprobs`` /
    ``ref_logprobs`` to ``loss_fn`` when ``loss_fn`` takes them (read once from its signature,
    as the trainer reads a loss's, with :func:`rlblocks.losses.inputs.loss_inputs`). Its
    signature says just that (:func:`rlblocks.losses.inputs.forwarding_signature`), so the
    trainer computes the entropy only when ``loss_fn`` takes it or ``log_entropy`` is on. Metrics:
    those of ``loss_fn`` and ``kl_loss`` (the mean k over valid tokens, detached; the recipes
    also report it as ``kl/token``, see `rlblocks.run.clock`).
    """
    wanted = loss_inputs(loss_fn).accepted

    def loss(
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        /,
        *,
        ref_logprobs: Tensor,
        **inputs: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        inputs["ref_logprobs"] = ref_logprobs
        kwargs = {k: v for k, v in inputs.items() if k in wanted}
        per_token, metrics = loss_fn(logprobs, old_logprobs, advantages, mask, **kwargs)
        kl, kl_metrics = kl_loss(logprobs, ref_logprobs, mask, estimator=estimator)
        return per_token + kl_coef * kl, {**metrics, "kl_loss": kl_metrics["kl"]}

    # What the trainer reads: ref_logprobs and what loss_fn takes, not everything **inputs
    # could hold (else it would compute the entropy, with its gradient, for nothing).
    loss.__signature__ = forwarding_signature(loss_fn, required=["ref_logprobs"])  # type: ignore[attr-defined]  # inspect.signature reads it
    return loss


def _last_valid_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    # Index of the last True in each row (b), and whether the row has any True (b).
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=-1)
    return last.clamp(min=0), last >= 0


@torch.no_grad()
def kl_penalty_rewards(
    rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    /,
    *,
    kl_coef: float,
    estimator: KLEstimator = k1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token rewards with a KL penalty: r_t = −β·k_t, plus the outcome reward at the end.

    Ziegler et al. 2019 (arXiv 1909.08593, sec. 2.2) and InstructGPT (Ouyang et al. 2022,
    arXiv 2203.02155, sec. 3.5): R(x, y) = r(x, y) − β log(π_θ(y|x)/π_ref(y|x)), spread over
    the tokens:

        r_t = −β·k(t)                     on every valid token t
        r_T += rewards_i                  on the row's last valid token T, for ``rewards`` (b)
        r_t += rewards_it                 on every valid token, for ``rewards`` (b t)

    With the default k1 the summed penalty is exactly −β log(π_θ(y|x)/π_ref(y|x)), whose
    expectation is −β KL(π_θ ‖ π_ref) and whose score-function gradient is unbiased. A row
    with no valid token gets no reward at all (there is no token to put it on).

    Shapes: ``rewards`` ``(b)`` or ``(b t)``; ``logprobs``, ``ref_logprobs`` ``(b t)``;
    ``mask`` ``(b t)`` bool. Returns ``token_rewards`` ``(b t)`` float32, zero where ``mask`` is
    False, and metrics: ``kl`` (mean estimate over valid tokens), ``kl_per_seq`` (mean over
    sequences with a valid token of Σ_t k_t: the per-episode KL of Ziegler et al., the unit an
    :class:`AdaptiveKLController` target is usually given in) and ``kl_penalty`` (mean over
    those sequences of −β Σ_t k_t). Everything is detached (computed under ``no_grad``).
    """
    finite = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    kl = estimator(torch.where(mask, logprobs, finite), torch.where(mask, ref_logprobs, finite))
    kl = kl.float()
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    token_rewards = torch.where(mask, -kl_coef * kl, zero)
    if rewards.dim() == 1:
        last, has_token = _last_valid_index(mask)
        outcome = torch.where(has_token, rewards.to(kl.dtype), zero)
        token_rewards = token_rewards.scatter_add(-1, last[:, None], outcome[:, None])
    else:
        token_rewards = token_rewards + torch.where(mask, rewards.to(kl.dtype), zero)
    rows = mask.any(dim=-1)
    kl_per_seq = masked_sum(kl, mask, dim=-1)
    metrics = {
        "kl": masked_mean(kl, mask),
        "kl_per_seq": masked_mean(kl_per_seq, rows),
        "kl_penalty": masked_mean(-kl_coef * kl_per_seq, rows),
    }
    return token_rewards, metrics


class FixedKLController:
    """A constant KL coefficient β, with the same interface as :class:`AdaptiveKLController`.

    ``value`` is β; ``update`` does nothing. A fixed β is configuration, not state: ``state_dict``
    records it (``{"value": β}``), and ``load_state_dict`` keeps the β this controller was built
    with, so that a run resumed with another ``kl_coef`` trains with the new one (an
    :class:`AdaptiveKLController`'s β is state, and goes on from the saved one).
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> float:
        """Leave β unchanged and return it (the arguments are accepted for interchangeability)."""
        return self.value

    def state_dict(self) -> dict[str, float]:
        """The coefficient, ``{"value": β}``, recorded in checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Nothing to restore: β is this controller's configuration (class docstring)."""


class AdaptiveKLController:
    """The proportional KL controller of Ziegler et al. 2019 (arXiv 1909.08593, sec. 2.2).

    Drives the measured KL towards ``target`` by adjusting β after every batch:

        e_t     = clip(KL_t / target − 1, −0.2, 0.2)
        β_{t+1} = β_t · (1 + e_t · n_steps / horizon)

    ``n_steps`` is the number of samples (episodes) the measurement covers and ``horizon`` the
    number of samples over which a persistent error is corrected (Ziegler et al. use 10 000).
    ``current_kl`` must be in the unit ``target`` is given in: Ziegler et al. use the KL of a
    whole episode (the ``kl_per_seq`` metric of :func:`kl_penalty_rewards`); verl feeds a mean
    of per-token KLs. State: ``{"value": β}``; ``target`` and ``horizon`` are configuration.
    """

    def __init__(self, init_kl_coef: float, *, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController: target={target}, horizon={horizon}; use target > 0 and "
                "horizon > 0"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | Tensor, n_steps: int) -> float:
        """Apply one proportional step with the KL measured over ``n_steps`` samples; return β."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        """The current coefficient, ``{"value": β}``, for checkpointing."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore β from :meth:`state_dict`."""
        self.value = float(state["value"])
