"""The contracts of rlblocks: one ``Protocol`` per block. Reading this file shows the whole API.

One step of RL, as data flows::

    prompts ──► RolloutEngine.generate ──► Rollouts
    Rollouts ──► RewardFn ──► RewardOutput(rewards (b), metrics)
    Rollouts ──► PolicyTrainer.logprobs ──► old / ref log-probs (b t)
    rewards, mask, group_ids ──► AdvantageEstimator ──► Advantages(advantages, returns) (b t)
    Rollouts + advantages ──► PolicyTrainer.step(loss_fn=PolicyLoss) ──► metrics
    PolicyTrainer ──► Resharder.sync ──► RolloutEngine (new weights)

Blocks are structural: any object with these methods is a block, no base class to inherit.
Shapes use ``b`` sequences, ``t`` response tokens (see docs/conventions.md); every ``mask`` is
bool with True meaning "this token counts".

This module imports nothing else from rlblocks except the ``Rollouts`` data type, which is
itself free of rlblocks imports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

from torch import Tensor

from rlblocks.rollouts import Rollouts

__all__ = [
    "AdvantageEstimator",
    "Advantages",
    "Aggregation",
    "Placement",
    "PolicyLoss",
    "PolicyTrainer",
    "Prompt",
    "Resharder",
    "RewardFn",
    "RewardOutput",
    "RolloutEngine",
    "Rollouts",
    "SamplingParams",
    "Stateful",
]

T = TypeVar("T")

#: A prompt is raw text, or chat messages ``[{"role": "user", "content": "..."}]`` that the
#: engine renders with the tokenizer's chat template.
Prompt = str | Sequence[Mapping[str, str]]


# ---------------------------------------------------------------------- data returned by blocks
class Advantages(NamedTuple):
    """What an advantage estimator returns to the policy (and, for PPO, the value) loss.

    Both fields are ``(b t)`` float32, detached, and exactly zero where ``mask`` is False.
    """

    advantages: Tensor  # (b t) float32: the per-token weight of ∇ log π in the policy gradient
    returns: Tensor  # (b t) float32: the target a value function would regress on


class RewardOutput(NamedTuple):
    """What a reward function returns: ``rewards`` (b) float32 and scalar metrics."""

    rewards: Tensor
    metrics: dict[str, float]


@dataclass(frozen=True)
class SamplingParams:
    """How a RolloutEngine samples. Engines map these onto their own parameters."""

    max_new_tokens: int = 256
    """Longest response, in tokens."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    stop: tuple[str, ...] = ()
    """Strings that end a response (the stop string is kept in the response)."""
    seed: int | None = None
    """Seed for reproducible sampling; None draws from the global generator."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")


# ---------------------------------------------------------------------- pure-function blocks
class AdvantageEstimator(Protocol):
    """``estimator(rewards, mask, group_ids, /, **extras) -> Advantages``.

    rewards: (b) outcome rewards or (b t) per-token rewards; mask: (b t) bool;
    group_ids: (b) int64, any ids, not necessarily contiguous. Extra inputs (``values`` for
    GAE, ``baseline_rewards`` for ReMax) and hyperparameters are keyword-only. Pure, no grad.
    """

    def __call__(
        self, rewards: Tensor, mask: Tensor, group_ids: Tensor, /, **kwargs: Any
    ) -> Advantages: ...


class PolicyLoss(Protocol):
    """``loss_fn(logprobs, old_logprobs, advantages, mask, /, **kw) -> (loss, metrics)``.

    All inputs (b t); ``logprobs`` carries the gradient. ``loss`` is per token, (b t) float32,
    zero where ``mask`` is False; the trainer reduces it with an ``Aggregation`` and a
    mini-batch-wide normalizer. ``metrics`` are detached float32 scalars. Further per-token
    inputs the trainer has (``ref_logprobs``, ``entropy``, ``rollout_logprobs``) arrive as
    keywords; a loss takes the ones it needs.
    """

    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        /,
        **kwargs: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


class Aggregation(Protocol):
    """Reduces a per-token loss (b t) to a scalar: ``masked sum / normalizer``.

    ``normalizer(mask)`` is computed once over the whole mini-batch (summed over data-parallel
    ranks) and passed to every micro-batch call, so gradient accumulation changes nothing.
    """

    def normalizer(self, mask: Tensor) -> Tensor: ...

    def __call__(self, loss: Tensor, mask: Tensor, normalizer: Tensor | float) -> Tensor: ...


class RewardFn(Protocol):
    """``reward_fn(rollouts) -> RewardOutput``: one scalar reward per row, plus metrics.

    Reads ``rollouts.completions``, ``rollouts.prompts`` and ``rollouts.metadata`` (ground
    truth, data source). ``rlblocks.rewards.per_sample`` adapts a plain
    ``fn(completion, **row) -> float``.
    """

    def __call__(self, rollouts: Rollouts, /) -> RewardOutput: ...


# ---------------------------------------------------------------------- stateful blocks
@runtime_checkable
class Stateful(Protocol):
    """Anything whose state can be saved and restored exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples responses. Token-in/token-out: generated ids are never re-tokenized."""

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        n: int = 1,
        sampling: SamplingParams | None = None,
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rollouts:
        """``n`` samples per prompt; rows of one prompt share a group id. ``metadata[i]`` is
        copied onto every row of prompt ``i``. Rollout log-probs are float32 (b t)."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """Load new weights (Hugging Face parameter names), the Resharder's entry point."""
        ...


@runtime_checkable
class PolicyTrainer(Stateful, Protocol):
    """A policy model and its optimizer."""

    def logprobs(self, rollouts: Rollouts) -> Tensor:
        """Log-probs of the response tokens under the current weights, (b t) float32, no grad."""
        ...

    def step(
        self, rollouts: Rollouts, advantages: Tensor, *, loss_fn: PolicyLoss
    ) -> dict[str, float]:
        """One policy update (mini-batches, epochs, micro-batches) on a batch; metrics back."""
        ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full (unsharded) weights with Hugging Face names, for the Resharder."""
        ...


@runtime_checkable
class Resharder(Protocol):
    """Moves a trainer's weights into a rollout engine after an update."""

    def sync(self, trainer: PolicyTrainer, engine: RolloutEngine) -> dict[str, float]:
        """Push the weights; return metrics such as ``sync/seconds`` and ``sync/bytes``."""
        ...


@runtime_checkable
class Placement(Protocol):
    """Where each role (``actor``, ``rollout``, ``ref``, ``critic``, ``reward``) runs.

    ``build`` returns a handle with the same methods as the block that ``factory`` builds:
    ``Local()`` returns the block itself; a Ray placement returns a worker-group handle that
    scatters ``Rollouts`` across data-parallel ranks and gathers the results in order.
    """

    def build(self, role: str, factory: Callable[..., T], /, *args: Any, **kwargs: Any) -> T: ...

    def shutdown(self) -> None:
        """Release what the placement started (worker processes, a Ray instance)."""
        ...
