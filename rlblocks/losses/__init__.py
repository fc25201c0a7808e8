"""Per-token losses ``(b t)`` with metrics, and their reduction to a scalar.

See docs/conventions.md: every loss returns ``(loss, metrics)`` with ``loss`` ``(b t)`` float32,
zero where ``mask`` is False; :func:`aggregate` turns it into the scalar to back-propagate.
"""

from rlblocks.losses.aggregate import (
    AGGREGATIONS,
    Aggregation,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    SeqMeanTokenSumNorm,
    TokenMean,
    aggregate,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)
from rlblocks.losses.cispo import cispo
from rlblocks.losses.cov import clip_cov, kl_cov
from rlblocks.losses.distill import reverse_kl
from rlblocks.losses.entropy import entropy_from_logits, entropy_loss, token_logprobs
from rlblocks.losses.gpg import gpg_loss
from rlblocks.losses.gspo import gspo
from rlblocks.losses.kl import (
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    k1,
    k2,
    k3,
    kl_abs,
    kl_loss,
    kl_penalty_rewards,
    kl_regularized,
    low_var_kl,
)
from rlblocks.losses.mismatch import TruncatedIS, rollout_mismatch
from rlblocks.losses.ppo import clipped_surrogate
from rlblocks.losses.sft import nll
from rlblocks.losses.value import value_loss

__all__ = [
    "AGGREGATIONS",
    "AdaptiveKLController",
    "Aggregation",
    "FixedKLController",
    "KLEstimator",
    "SeqMeanTokenMean",
    "SeqMeanTokenSum",
    "SeqMeanTokenSumNorm",
    "TokenMean",
    "TruncatedIS",
    "aggregate",
    "cispo",
    "clip_cov",
    "clipped_surrogate",
    "entropy_from_logits",
    "entropy_loss",
    "gpg_loss",
    "gspo",
    "k1",
    "k2",
    "k3",
    "kl_abs",
    "kl_cov",
    "kl_loss",
    "kl_penalty_rewards",
    "kl_regularized",
    "low_var_kl",
    "nll",
    "reverse_kl",
    "rollout_mismatch",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_logprobs",
    "token_mean",
    "value_loss",
]
