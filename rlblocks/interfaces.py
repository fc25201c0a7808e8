"""The contracts of rlblocks: one ``Protocol`` per block. Reading this file shows the whole API.

One step of RL, as data flows::

    prompts ──► RolloutEngine.generate ──► Rollouts
    Rollouts ──► RewardFn ──► RewardOutput(rewards (b), metrics)
    Rollouts ──► PolicyTrainer.logprobs ──► old / ref log-probs (b t)
    Rollouts ──► Teacher.logprobs ──► a teacher's log-probs (b t)   (on-policy distillation)
    rewards, mask, group_ids ──► AdvantageEstimator ──► Advantages(advantages, returns) (b t)
    Rollouts + advantages ──► PolicyTrainer.step(loss_fn=PolicyLoss) ──► metrics
        (or, a loop of one's own: forward_backward × k, then optim_step)
    PolicyTrainer ──► Resharder.sync ──► RolloutEngine (new weights)

Blocks are structural: any object with these methods is a block, no base class to inherit.
Shapes use ``b`` sequences, ``t`` response tokens (see docs/conventions.md); every ``mask`` is
bool with True meaning "this token counts".

Everything one block relies on in another is written here, so nothing is probed with
``getattr`` or ``inspect``: the engine's sleep/wake and adapters, the trainer's bucketed
weights and adapter export, the critic, sharding (:class:`Shardable`), how a placement splits a
method's arguments over its workers (:class:`Dispatch`) and what a placement's handle carries
for the resharder (:class:`Handle`). docs/architecture.md draws the seam.

This module imports nothing else of rlblocks but ``Rollouts``, ``Dispatch``
(``rlblocks.base.dispatch``) and ``SamplingParams`` (``rlblocks.base.sampling``), all free of
rlblocks imports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor, nn

from rlblocks.base.dispatch import Dispatch, dispatch, dispatch_of
from rlblocks.base.sampling import SamplingParams
from rlblocks.rollouts import Rollouts

__all__ = [
    "AdvantageEstimator",
    "Advantages",
    "Aggregation",
    "Checkpointable",
    "Critic",
    "Dispatch",
    "EngineMemory",
    "Handle",
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
    "Shardable",
    "SizedEngine",
    "Stateful",
    "Teacher",
    "TensorSpec",
    "WeightSpec",
    "dispatch",
    "dispatch_of",
]

T = TypeVar("T")

#: A prompt is raw text, chat messages ``[{"role": "user", "content": "..."}]`` that the
#: engine renders with the tokenizer's chat template, or token ids used as they are (a
#: multi-turn rollout hands back the conversation so far, never re-tokenizing sampled ids).
Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]


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


class TensorSpec(NamedTuple):
    """A weight without its values: what a sync is checked against before anything moves."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        """The spec of ``tensor`` (a sharded ``DTensor`` gives its global shape)."""
        return cls(tuple(tensor.shape), tensor.dtype)


#: Hugging Face weight name -> shape and dtype (``weight_spec`` of engines and trainers).
WeightSpec = Mapping[str, TensorSpec]


# ---------------------------------------------------------------------- pure-function blocks
class AdvantageEstimator(Protocol):
    """``estimator(rewards, mask, group_ids, /, **extras) -> Advantages``.

    rewards: (b) outcome rewards or (b t) per-token rewards; mask: (b t) bool;
    group_ids: (b) int64, any ids, not necessarily contiguous. Extra inputs (``values`` for
    GAE, ``baseline_rewards`` for ReMax) and hyperparameters are keyword-only. Pure, no grad.
    """

    # ``*args: Any, **kwargs: Any`` after the three tensors: any further parameters (for a type
    # checker, ``Concatenate[Tensor, Tensor, Tensor, ...]``), so that an estimator with its own
    # keyword-only hyperparameters (``grpo(..., *, scale_by_std=True)``) is one.
    def __call__(
        self, rewards: Tensor, mask: Tensor, group_ids: Tensor, /, *args: Any, **kwargs: Any
    ) -> Advantages: ...


class PolicyLoss(Protocol):
    """``loss_fn(logprobs, old_logprobs, advantages, mask, /, **kw) -> (loss, metrics)``.

    All inputs (b t); ``logprobs`` carries the gradient. ``loss`` is per token, (b t) float32,
    zero where ``mask`` is False; the trainer reduces it with an ``Aggregation`` and a
    mini-batch-wide normalizer. ``metrics`` are detached float32 scalars. Further per-token
    inputs the trainer has (``ref_logprobs``, ``entropy``, ``rollout_logprobs``) arrive as
    keywords; a loss takes the ones it needs.
    """

    # ``*args: Any, **kwargs: Any``: any further parameters (see AdvantageEstimator), so that a
    # loss with its own keyword-only inputs and hyperparameters (``clipped_surrogate(..., *,
    # clip=...)``) is one.
    def __call__(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        /,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


class Aggregation(Protocol):
    """Reduces a per-token loss (b t) to a scalar: ``masked sum / normalizer``.

    ``normalizer(mask)`` is computed once over the whole mini-batch (summed over data-parallel
    ranks) and passed to every micro-batch call, so gradient accumulation changes nothing.
    """

    def normalizer(self, mask: Tensor) -> Tensor:
        """The mini-batch normalizer n(M) computed from its whole response mask (b t) bool."""

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

    def state_dict(self) -> dict[str, Any]:
        """The block's state, enough to resume it exactly."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state returned by ``state_dict``."""


@runtime_checkable
class Checkpointable(Protocol):
    """A block that writes its own part of a run's checkpoint into a folder (the trainers).

    Preferred over `Stateful` by ``rlblocks.checkpoint``: a trainer writes its model in the
    Hugging Face format and its optimizer sharded, which a dict in memory cannot do. On a
    placement with several workers every worker is called with the same folder; they write
    their own shards there (the folder must be on a file system they all see).
    """

    def save_checkpoint(self, folder: str | Path) -> None:
        """Write this block's part of a run checkpoint into ``folder``."""

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore this block from ``folder``, written by ``save_checkpoint``."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples responses. Token-in/token-out: generated ids are never re-tokenized."""

    @property
    def model(self) -> nn.Module | None:
        """The torch module the engine samples with when it lives in this process (``HFEngine``),
        None when its weights are held elsewhere (vLLM). An engine whose ``model`` *is* the
        trainer's sees every update without a copy. (Read-only here, so that an engine that
        always has a module may declare ``model: nn.Module``.)"""

    serves_adapters: bool
    """True when the engine applies a LoRA adapter itself (:meth:`load_adapter`), so a LoRA
    policy's sync moves only the adapter; False: it takes merged weights."""

    tokenizer: Any
    """The tokenizer that turns prompts into the ids the engine samples from (None for a
    scripted engine without one); the resharder checks it is the trainer's."""

    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        group_size: int = 1,
        sampling: SamplingParams | None = None,
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rollouts:
        """``group_size`` (g) samples for each prompt: a ``Rollouts`` of ``b = len(prompts) · g`` rows.

        Rows ``i·g … i·g+g−1`` belong to prompt ``i`` and carry group id ``i``; each gets a
        fresh (shallow) copy of ``metadata[i]``. ``prompts`` holds the rendered prompt text,
        ``completions`` the decoded response (special tokens skipped). ``rollout_logprobs`` (b t)
        float32 = log softmax(z_t / T)[y_t] (T = 1 when greedy), 0 after a row's end; with
        ``sampling.replay``, of the truncated distribution sampled from, and ``sampler`` (b 3)
        records (T, top_k, top_p) per row. Nothing carries grad. ``sampling`` None: the
        engine's default; with ``sampling.seed`` the result is reproducible. What can be
        refused (``group_size < 1``, a prompt past the context) is, before any compute."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """Load new weights (Hugging Face parameter names), the Resharder's entry point."""
        ...

    def weight_spec(self) -> WeightSpec | None:
        """Every weight :meth:`update_weights` takes, by Hugging Face name (tied weights under
        each of their names), with the shape and dtype the engine holds it in. A full sync must
        send exactly these names and shapes; the resharder checks that before it writes
        anything. None: the engine declares nothing and takes any stream unchecked (a scripted
        engine that ignores weights)."""
        ...

    def load_adapter(self, path: str | Path, *, version: int) -> None:
        """Sample with the LoRA adapter saved in ``path`` (peft's layout) from now on; engines
        with ``serves_adapters`` False raise."""
        ...

    def sleep(self) -> None:
        """Free the accelerator memory the engine holds between rollouts (a colocated trainer
        needs it for the update); a no-op where there is nothing to free. An engine may also
        sleep by itself after each ``generate`` (``VLLMEngine(enable_sleep_mode=True)`` does),
        so that no recipe has to call it."""
        ...

    def wake_up(self) -> None:
        """Take the memory back; ``generate`` and ``update_weights`` wake a sleeping engine."""
        ...


@dataclass(frozen=True)
class EngineMemory:
    """How a rollout engine holds memory: what `rlblocks.planner.plan` sizes for it.

    ``kv_cache``: ``"rows"``, the keys and values of the rows one ``generate`` samples (rows ×
    tokens × layers × key and value width × dtype bytes, plus two float32 score rows per row),
    freed after the call (``HFEngine``); ``"pool"``, a share of the device taken once
    (``gpu_memory_utilization``), its weights included (vLLM). ``own_weights``: it holds a
    copy of the weights rather than sampling with the trainer's module. ``sleeps``: it can
    free its memory while a colocated trainer updates. ``name``: how a plan names it."""

    name: str
    kv_cache: Literal["rows", "pool"] = "rows"
    own_weights: bool = False
    sleeps: bool = False

    def __str__(self) -> str:
        return self.name


@runtime_checkable
class SizedEngine(Protocol):
    """An engine (its class or an instance) that tells the planner how it holds memory: every
    engine ``rlblocks.rollout.ENGINES`` names is one, and ``rb.plan(engine=...)`` takes it."""

    def memory_model(self) -> EngineMemory:
        """What the engine keeps per device (:class:`EngineMemory`); a classmethod, so the
        class answers before any engine is built."""
        ...


@runtime_checkable
class PolicyTrainer(Stateful, Protocol):
    """A policy model and its optimizer."""

    model: nn.Module
    """The module being trained (peft-wrapped with LoRA): an in-process engine may share it.
    An engine whose ``model`` is this one samples with the trainer's current weights: its
    log-probs at ``config.temperature`` are π_old (``rlblocks.run.samples_with_policy``)."""
    config: Any
    """Optimizer, batching and numerics (``rlblocks.trainer.TrainConfig``); ``temperature``
    divides the logits of every score."""
    has_adapter: bool
    """True when only a LoRA adapter is trained (:meth:`save_adapter` exports it)."""
    tokenizer: Any
    """The policy's tokenizer, or None when it was built without one (nothing to compare)."""

    def logprobs(self, rollouts: Rollouts) -> Tensor:
        """Log-probs of the response tokens under the current weights, (b t) float32, no grad."""
        ...

    def ref_logprobs(self, rollouts: Rollouts) -> Tensor:
        """Log-probs under the reference policy, (b t) float32, no grad."""
        ...

    def step(
        self,
        rollouts: Rollouts,
        advantages: Tensor | Advantages,
        *,
        loss_fn: PolicyLoss,
        minibatches: Sequence[Tensor] | None = None,
    ) -> dict[str, float]:
        """One policy update (epochs × mini-batches × micro-batches) on a batch; metrics back.

        π_old is ``rollouts.old_logprobs``, else the trainer's own (docs/run.md);
        ``minibatches`` replaces the drawn mini-batch plan (row indices per optimizer step).
        In a data-parallel group every rank gets the whole batch and trains on its share."""
        ...

    def forward_backward(
        self,
        rollouts: Rollouts,
        advantages: Tensor | Advantages,
        *,
        loss_fn: PolicyLoss,
        normalizer: Tensor | float | None = None,
    ) -> dict[str, float]:
        """Forward, loss aggregated with ``normalizer`` (default: this call's own), backward:
        gradients accumulate over calls until :meth:`optim_step` (Tinker's primitives). k calls
        over k chunks of one batch pass that batch's :meth:`normalizer`. This call's loss and
        metrics back; π_old defaults as in :meth:`step` for a one-mini-batch update."""
        ...

    def optim_step(self) -> dict[str, float]:
        """Apply what :meth:`forward_backward` accumulated: NaN guard, clip, optimizer,
        schedule; ``grad_norm``, ``lr``, ``optimizer_steps``, ``skipped_steps`` back. Raises
        when nothing is pending."""
        ...

    def normalizer(self, rollouts: Rollouts) -> Tensor:
        """The aggregation's normalizer of the batch's response mask (a scalar), for the
        :meth:`forward_backward` calls over its chunks."""
        ...

    def named_weights(self, *, bucket_bytes: int | None = None) -> Iterator[tuple[str, Tensor]]:
        """Full (unsharded) weights with Hugging Face names, for the Resharder; a sharded
        trainer gathers them in collectives of about ``bucket_bytes`` (every rank iterates)."""
        ...

    def weight_spec(self) -> WeightSpec:
        """Name, shape and dtype of each tensor :meth:`named_weights` yields, in its order,
        from metadata alone: nothing gathered, nothing merged. Every rank gives the same."""
        ...

    def save_adapter(self, folder: str | Path) -> None:
        """Write the LoRA adapter (peft's ``save_pretrained``: weights and config) into
        ``folder``; trainers with ``has_adapter`` False raise."""
        ...

    def save_pretrained(self, folder: str | Path, *, merge_lora: bool = True) -> Path:
        """Export the policy as a Hugging Face folder (weights, config, tokenizer, generation
        config) that transformers and vLLM load; with LoRA, ``merge_lora=False`` writes the
        adapter (peft's layout) instead of the merged model. Every data-parallel rank calls;
        rank 0 writes."""
        ...


@runtime_checkable
class Critic(Stateful, Protocol):
    """A value model and its optimizer (PPO's critic)."""

    def values(self, rollouts: Rollouts) -> Tensor:
        """V of every response token, (b t) float32, 0 where the response mask is False."""
        ...

    def step(
        self,
        rollouts: Rollouts,
        returns: Tensor | Advantages,
        *,
        old_values: Tensor | None = None,
        clip: float | None = 0.2,
        minibatches: Sequence[Tensor] | None = None,
    ) -> dict[str, float]:
        """One critic update towards ``returns`` (clipped value loss); ``vf_*`` metrics back."""
        ...


@runtime_checkable
class Teacher(Protocol):
    """A frozen model that scores the tokens a student sampled (on-policy distillation)."""

    def logprobs(self, rollouts: Rollouts) -> Tensor:
        """log π_T of every response token, ``(b t)`` float32, 0 at padding; no grad."""


@runtime_checkable
class Shardable(Protocol):
    """A block that shards itself over a data-parallel group (the trainers: FSDP2).

    A placement calls ``shard(group)`` once, right after building the block in each worker of
    a group; the block decides what that means (stay whole in a group of one, refuse what it
    cannot shard) and from then on splits its own work and reduces its own metrics."""

    def shard(self, group: Any = None) -> None:
        """Join a data-parallel process group (None: the default group)."""

    # Optional, read after ``shard``: ``row_replicas`` (int, default 1), how many consecutive
    # ranks must receive the same rows (a tensor-parallel group computes one forward
    # together): a placement splits a ``Dispatch.ROWS`` call over size / row_replicas groups.


@runtime_checkable
class Resharder(Protocol):
    """Moves a trainer's weights into a rollout engine after an update."""

    def sync(self, trainer: PolicyTrainer, engine: RolloutEngine) -> dict[str, float]:
        """Push the weights; return metrics such as ``sync/seconds`` and ``sync/bytes``."""

    def resync(self, trainer: PolicyTrainer, engine: RolloutEngine) -> dict[str, float]:
        """Push the weights again without a new version (a run resumed from a checkpoint)."""


@runtime_checkable
class Placement(Protocol):
    """Where each role (``actor``, ``rollout``, ``ref``, ``critic``, ``reward``) runs.

    ``build`` returns a handle with the same methods as the block that ``factory`` builds:
    ``Local()`` returns the block itself; a Ray placement returns a worker-group handle that
    splits each call over its workers as the method's :class:`Dispatch` says.
    """

    def build(self, role: str, factory: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Build a block for ``role`` with ``factory(*args, **kwargs)``: the block itself, or a
        handle with the same methods."""

    def shutdown(self) -> None:
        """Release what the placement started (worker processes, a Ray instance)."""


@runtime_checkable
class Handle(Protocol):
    """A block living in other processes, behind a placement's handle (a Ray worker group):
    it shares no module with this process, so it never samples with a local trainer's weights.

    Its methods are the block's; ``run_with`` is the one thing more: it carries a function to
    where the block lives, for work that must happen next to the weights (a resharder's copy).
    The placement runs the function and knows nothing of what it does."""

    def run_with(self, fn: Callable[[Any, Any], T], other: Any, /) -> list[T]:
        """``fn(block, other's block)`` in every worker of this handle.

        When ``other`` is a handle on the same workers, ``fn`` gets its block in the same
        process, and every worker's answer comes back, by rank. Otherwise ``fn`` gets a
        stand-in for it whose ``model`` is None and ``serves_adapters`` False; the calls the
        first worker's ``fn`` makes on it are carried to ``other``, in order, once ``fn`` has
        returned, and only the first worker's answer comes back (the other workers' calls are
        dropped: their ``fn`` runs only for the collectives it takes part in)."""
