"""Per-token losses ``(b t)`` with metrics, and their reduction to a scalar.

See docs/conventions.md: every loss returns ``(loss, metrics)`` with ``loss`` ``(b t)`` float32,
zero where ``mask`` is False; :func:`aggregate` turns it into the scalar to back-propagate.
The pairwise preference losses (:func:`dpo`, :func:`ipo`, :func:`simpo`) are per pair ``(P)``
instead; :func:`preference_advantages` turns them into per-token advantages for the trainer.

``LOSSES``, ``PREFERENCES``, ``AGGREGATIONS`` and ``CORRECTIONS`` name these blocks for config
files and command lines (`rlblocks.base.registry`); each registers itself beside its definition.
"""

from rlblocks.interfaces import Aggregation
from rlblocks.losses.aggregate import (
    AGGREGATIONS,
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
from rlblocks.losses.entropy import (
    entropy_from_logits,
    entropy_loss,
    linear_token_scores,
    token_logprobs,
    vocab_parallel_token_scores,
)
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
from rlblocks.losses.mismatch import rollout_mismatch
from rlblocks.losses.names import LOSSES, PREFERENCES
from rlblocks.losses.offpolicy import (
    CORRECTIONS,
    MaskedIS,
    OffPolicyCorrection,
    TruncatedIS,
    importance_ratios,
)
from rlblocks.losses.ppo import clipped_surrogate
from rlblocks.losses.preference import (
    PreferenceLoss,
    dpo,
    ipo,
    preference_advantages,
    preference_loss,
    ranked_pairs,
    simpo,
    uses_reference,
)
from rlblocks.losses.sft import nll
from rlblocks.losses.value import value_loss

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "LOSSES",
    "PREFERENCES",
    "AdaptiveKLController",
    "Aggregation",
    "FixedKLController",
    "KLEstimator",
    "MaskedIS",
    "OffPolicyCorrection",
    "PreferenceLoss",
    "SeqMeanTokenMean",
    "SeqMeanTokenSum",
    "SeqMeanTokenSumNorm",
    "TokenMean",
    "TruncatedIS",
    "aggregate",
    "cispo",
    "clip_cov",
    "clipped_surrogate",
    "dpo",
    "entropy_from_logits",
    "entropy_loss",
    "gpg_loss",
    "gspo",
    "importance_ratios",
    "ipo",
    "k1",
    "k2",
    "k3",
    "kl_abs",
    "kl_cov",
    "kl_loss",
    "kl_penalty_rewards",
    "kl_regularized",
    "linear_token_scores",
    "low_var_kl",
    "nll",
    "preference_advantages",
    "preference_loss",
    "ranked_pairs",
    "reverse_kl",
    "rollout_mismatch",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "simpo",
    "token_logprobs",
    "token_mean",
    "uses_reference",
    "value_loss",
    "vocab_parallel_token_scores",
]
