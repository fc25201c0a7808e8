"""``PolicyTrainer``: a causal LM and its AdamW optimizer, updated in this process.

One call of :meth:`PolicyTrainer.step` is the whole PPO-style update of verl's
``update_policy`` or OpenRLHF's ``PPOTrainer.training_step``: π_old and π_ref ready before any
update (``rlblocks.trainer.policy_loss.prepare_update``; π_old from the update's own forward when it
is one optimizer step, ``rlblocks.trainer.pi_old``), then epochs × mini-batches shuffled by
``(config.shuffle_seed, step calls so far)``, per mini-batch one normalizer and per
micro-batch forward, loss, ``aggregate``, backward, then NaN guard, clip, AdamW, schedule.
That loop is shared with the critic (``rlblocks.trainer.update``); this class supplies the
loss of one micro-batch (``rlblocks.trainer.policy_loss.micro_loss``) and the scores of π_θ
and π_ref (``rlblocks.trainer.policy_scoring``).

For a loop of one's own (Tinker's API), :meth:`~PolicyTrainer.forward_backward` is the first
half of a mini-batch (gradients accumulate over calls) and :meth:`~PolicyTrainer.optim_step`
the second; ``step`` runs the same two pieces of ``rlblocks.trainer.update`` per mini-batch.

Decisions worth knowing:

- **NaN guard.** If a micro-batch loss or the total gradient norm is not finite, the optimizer
  step is skipped: gradients are zeroed, weights and optimizer state are untouched and the
  schedule does not advance (it counts applied updates, so a bad batch does not eat warmup).
  It is counted in ``skipped_steps`` and a ``RuntimeWarning`` is raised. One host sync per
  mini-batch decides it, none per micro-batch.
- **Modes.** The model is in ``train()`` mode during the update (Hugging Face gradient
  checkpointing only runs in training mode) and in ``eval()`` mode otherwise. RL needs
  ``π_θ = π_old`` at the first mini-batch, so use models without dropout (LLM configs have 0).
- **dtypes.** Public log-probs are float32; inside ``step`` the loss sees log-probs in the
  model's precision promoted to float32 (float64 for a float64 model: tests compare
  micro-batchings at float64 tolerances that way).
- **Data parallelism.** Inside a worker group (``rlblocks.placement.Ray``) the placement calls
  :meth:`PolicyTrainer.shard` once; from then on every rank receives the whole batch, draws the
  same plan and trains on its own share of each mini-batch (``rlblocks.trainer.parallel``).
  Every place that must agree across ranks (the normalizer, the NaN decision, the number of
  micro-batches, the metrics) goes through ``self.dp``, a ``SingleProcess`` in one process.
- **Host memory.** With ``RLBLOCKS_KEEP_FREED_MEMORY=1`` (the main job sets it) a trainer on
  the CPU sets glibc's ``malloc`` to keep freed memory for reuse (``rlblocks.trainer.allocator``):
  without it every large tensor of a step is a fresh mapping the kernel faults in and zeroes.
  The setting holds for the whole process, so a trainer imported into a program of one's own
  leaves ``malloc`` alone unless asked.
- **Shared model.** ``trainer.model`` is the (possibly peft-wrapped) module; an in-process
  rollout engine can generate with it directly. ``named_weights()`` gives what a separate
  engine needs, with LoRA merged.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from rlblocks.interfaces import Advantages, Dispatch, PolicyLoss, TensorSpec, dispatch
from rlblocks.models import loading
from rlblocks.models.regional import compile_blocks
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.allocator import keep_freed_memory, opted_in
from rlblocks.trainer.batches import token_advantages
from rlblocks.trainer.checkpoint import load_trainer, load_weights, save_trainer, save_weights
from rlblocks.trainer.config import TrainConfig
from rlblocks.trainer.export import DEFAULT_COMMIT_MESSAGE, push_to_hub, save_pretrained
from rlblocks.trainer.lora import is_peft_model, wrap_lora
from rlblocks.trainer.numerics import fit_token_budget, resolve_numerics
from rlblocks.trainer.packing import check_isolation
from rlblocks.trainer.parallel import DataParallel, SingleProcess
from rlblocks.trainer.policy_loss import PreparedUpdate, prepare_update
from rlblocks.trainer.policy_scoring import ref_scores, reference_tensors, score, score_no_grad
from rlblocks.trainer.policy_state import (
    load_policy_state,
    policy_state,
    save_adapter,
    shard_policy,
)
from rlblocks.trainer.update import (
    Accumulation,
    Trained,
    assign,
    run_update,
    start_training,
    timing,
)
from rlblocks.trainer.weights import (
    frozen_reference,
    full_weight_spec,
    full_weights,
)

if TYPE_CHECKING:
    from peft import LoraConfig

Reference = Literal["auto", "copy"] | nn.Module | None


class PolicyTrainer(Trained):
    """A policy (Hugging Face causal LM, optionally with peft LoRA) and its optimizer.

    The trainer works on the device of ``model``'s parameters; ``from_pretrained`` puts the
    model on CUDA when torch sees a GPU, else on the CPU, unless ``device=`` says otherwise.

    ``reference``: ``"auto"`` (default) is the adapter-disabled model with LoRA and a frozen
    copy of the initial model otherwise; ``"copy"`` always makes the frozen copy; a module is
    used as given (frozen here); ``None`` means no reference (losses that need
    ``ref_logprobs`` then fail unless ``rollouts.ref_logprobs`` holds them).
    ``reference_dtype``: the reference model's dtype (None: as built), e.g. ``torch.bfloat16``
    beside a float32 policy: half the reference's memory, its log-probs computed in that
    precision; refused when there is no reference module (None, or LoRA's adapter-disabled
    model, which is the policy's own weights).
    ``lora``: a ``peft.LoraConfig``; only the adapters are trained. ``config_overrides``
    replace fields of ``config`` (``PolicyTrainer(model, lr=1e-5)``).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: TrainConfig | None = None,
        reference: Reference = "auto",
        reference_dtype: torch.dtype | None = None,
        lora: LoraConfig | None = None,
        tokenizer: Any = None,
        **config_overrides: Any,
    ) -> None:
        config = config or TrainConfig()
        self.config = dataclasses.replace(config, **config_overrides)
        if next(model.parameters()).device.type == "cpu" and opted_in():
            keep_freed_memory()  # no page faults for every large tensor (trainer.allocator)
        self.tokenizer = tokenizer
        adapter = lora is not None or is_peft_model(model)
        self._adapter_reference = reference == "auto" and adapter
        if reference == "auto":
            reference = None if adapter else "copy"
        self.reference = frozen_reference(model, reference)
        if reference_dtype is not None:
            if self.reference is None:
                why = ", LoRA: its reference is the policy's own base weights" if adapter else ""
                raise ValueError(
                    f"PolicyTrainer: reference_dtype={reference_dtype} needs a reference module, "
                    f"and this trainer has none (reference={reference!r}{why}); pass "
                    "reference='copy', or drop reference_dtype"
                )
            self.reference.to(reference_dtype)
        if self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable(  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.model = (wrap_lora(model, lora) if lora is not None else model).eval()
        parameter = next(self.model.parameters())
        self.config = resolve_numerics(  # bf16 and compile decided for this device
            self.config,
            parameter.device,
            parameter.dtype,
            owner="PolicyTrainer",
        )
        if self.config.compile:  # every decoder block compiled (rlblocks.models.regional)
            compile_blocks(self.model, owner="PolicyTrainer")
        self.has_adapter = is_peft_model(self.model)  # LoRA: only the adapter trains
        self.dp: SingleProcess | DataParallel = SingleProcess()  # see shard()
        self._accumulation = Accumulation()  # forward_backward's gradients until optim_step
        self._fit_token_budget()  # on a GPU: micro_batch_tokens from its free memory
        start_training(self)  # counters steps, optimizer_steps, skipped_steps; the optimizer
        if self.config.packing and self.reference is not None:
            check_isolation(self.reference, owner="PolicyTrainer (reference)")

    def _fit_token_budget(self) -> None:
        """``micro_batch_tokens`` from the device's free memory when unset on a GPU (printed
        with its reason), or a budget set by hand checked against it
        (``rlblocks.trainer.numerics.fit_token_budget``)."""
        self.config, reason = fit_token_budget(
            self.model, self.config, owner="PolicyTrainer", world=self.dp.size
        )
        self._chosen_budget = reason is not None
        if reason is not None:
            print(reason)

    # from_pretrained(name_or_path, *, dtype=float32, device=None, **kwargs): load, then
    # cls(model, tokenizer=tokenizer, **kwargs); the tokenizer is kept as trainer.tokenizer.
    # device None: CUDA when torch sees a GPU, else the CPU (rlblocks.models.default_device).
    from_pretrained: classmethod[PolicyTrainer, ..., PolicyTrainer] = classmethod(
        loading.from_pretrained
    )

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters."""
        return next(self.model.parameters()).device

    @property
    def layout(self) -> dict[str, int]:
        """The processes the trainer spans: ``{"dp": data-parallel size, "tp": tensor-parallel
        size, "sp": sequence-parallel size}`` (all 1 until ``shard``)."""
        sharded = self.dp.sharded
        return {
            "dp": self.dp.size,
            "tp": self.config.tp if sharded else 1,
            "sp": self.config.sp if sharded else 1,
        }

    @property
    def row_replicas(self) -> int:
        """Consecutive ranks that score the same rows (``Shardable``): a tensor- or
        sequence-parallel group."""
        return self.layout["tp"] * self.layout["sp"]

    def _check_layout(self, method: str) -> None:
        """Refuse to compute with ``tp`` or ``sp`` > 1 in a trainer never sharded: in one
        process nothing would split, and the setting would be dropped without a word."""
        if (self.config.tp > 1 or self.config.sp > 1) and not self.dp.sharded:
            kind, size = ("tp", self.config.tp) if self.config.tp > 1 else ("sp", self.config.sp)
            raise RuntimeError(
                f"PolicyTrainer.{method}: TrainConfig.{kind} = {size} splits the policy over "
                f"{size} processes, but this trainer runs in one and was never sharded; build "
                "it with a placement of several workers (rb.placement.Ray(workers=N), "
                f"rlblocks-train workers: N, a multiple of {size}), or set {kind}=1"
            )

    def shard(self, group: Any = None) -> None:
        """Join a data-parallel group (``torch.distributed``; None: the default group), as a
        placement does right after building the trainer in each worker (``Shardable``).

        The model (and a separate reference) become FSDP2 units unless the group has one
        process and ``config.fsdp`` is None (``rlblocks.trainer.fsdp.shard_modules``); the
        optimizer is rebuilt on the shards. A LoRA policy is sharded the same way: its frozen
        base weights and its adapters alike (FSDP2 units mix frozen and trained parameters);
        only the adapters' gradients are reduced, and a sync merges the gathered base weights
        with the adapters' delta (`rlblocks.trainer.weights.merged_sharded`).
        """
        shard_policy(self, group)

    # ------------------------------------------------------------------ scoring (no grad)
    @dispatch(Dispatch.ROWS)
    def logprobs(
        self, rollouts: Rollouts, *, entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """log π_θ(y_k | x, y_<k) of every response token under the current weights.

        Returns ``(b t)`` float32, 0 at response padding, no grad, on the device of
        ``rollouts`` (an engine's rows are on the CPU whatever the model's device, so
        ``ro.rollout_logprobs - policy.logprobs(ro)`` works on a GPU too); with
        ``entropy=True`` also the ``(b t)`` float32 entropy of each next-token distribution.
        Micro-batched like a training step; logits are divided by ``config.temperature``.
        """
        self._check_layout("logprobs")
        home = rollouts.response_ids.device
        lp, ent = score_no_grad(self, self.model, rollouts, entropy=entropy, replay=True)
        lp = lp.float().to(home)
        return (lp, ent.float().to(home)) if ent is not None else lp

    @dispatch(Dispatch.ROWS)
    def ref_logprobs(self, rollouts: Rollouts) -> Tensor:
        """log π_ref of every response token: ``(b t)`` float32, 0 at padding, no grad.

        π_ref is the frozen copy, the given reference module, or (LoRA) the model with its
        adapters disabled (peft's ``disable_adapter()``), i.e. the base model. On the device of
        ``rollouts``, as :meth:`logprobs`.
        """
        self._check_layout("ref_logprobs")
        return ref_scores(self, rollouts).float().to(rollouts.response_ids.device)

    # ------------------------------------------------------------------ the update
    @dispatch(Dispatch.ALL)
    def step(
        self,
        rollouts: Rollouts,
        advantages: Tensor | Advantages,
        *,
        loss_fn: PolicyLoss,
        minibatches: Sequence[Tensor] | None = None,
    ) -> dict[str, float]:
        """One policy update on a batch: epochs × mini-batches × micro-batches (module doc).

        Per mini-batch M: θ ← AdamW(θ, clip(∇_θ Σ_{micro ⊂ M} Σ_{i,t} ℓ_{i,t} / n(M))), with
        ℓ = ``loss_fn(...)`` per token and n(M) = ``config.aggregation.normalizer(mask_M)``.
        PPO's K epochs over shuffled mini-batches: Schulman et al. 2017, arXiv 1707.06347,
        Algorithm 1. AdamW: Loshchilov & Hutter 2017, arXiv 1711.05101, Algorithm 2. Gradient
        norm clipping: Pascanu et al. 2013, arXiv 1211.5063, Algorithm 1.

        ``advantages``: ``(b t)`` float32 (an ``Advantages`` tuple is unpacked; a ``(b)``
        tensor is broadcast over each row's valid tokens); detached. π_old travels with the
        rows: ``rollouts.old_logprobs`` when set; else, when the update is one optimizer step
        over all rows, the detached log-probs of the update's own forward (no scoring pass);
        else scored before the update (docs/run.md has the whole table). ``loss_fn`` follows the
        ``PolicyLoss`` protocol and also receives ``ref_logprobs`` (b t, detached), ``entropy``
        (b t, with gradient) and ``rollout_logprobs`` (b t) when its signature names them.

        Returns floats: ``loss`` (mean mini-batch loss), every loss metric and ``entropy``
        (when the loss takes it or ``config.log_entropy`` asks) averaged over micro-batches
        weighted by valid tokens, ``grad_norm`` (mean pre-clipping norm), ``lr`` (of the last
        applied update), ``optimizer_steps``, ``skipped_steps``, ``seconds`` (of which
        ``logprob_seconds`` scoring π_old and π_ref before the update), ``tokens_per_second``
        (real tokens × epochs / seconds) and, when the rollouts carry rollout log-probs,
        ``mismatch/abs_mean``, ``mismatch/abs_max`` and ``mismatch/kl`` (π_old against the
        engine's log-probs, ``rlblocks.losses.mismatch``). Metrics of skipped steps are left out
        (NaN if every step was skipped).

        ``minibatches``: the row indices of each optimizer step, in order, instead of the ones
        ``mini_batch_size``, ``epochs`` and ``shuffle_seed`` would draw. In a data-parallel
        group every rank gets the whole batch, trains on its share of each mini-batch
        (``rlblocks.trainer.parallel``) and returns the loss, metrics, ``grad_norm`` and
        timings of the whole group.
        """
        start = time.perf_counter()
        self._accumulation.refuse(self, "step")
        update = self._update(rollouts, advantages, loss_fn, minibatches, "step")
        scored = time.perf_counter()  # old (and reference) log-probs are ready
        metrics = run_update(self, update.work, update.loss)
        return {
            **update.mismatch(self.dp),
            **metrics,
            **timing(
                self.dp,
                time.perf_counter() - start,
                scored - start,
                rollouts.num_tokens,
                self.config.epochs,
            ),
        }

    @dispatch(Dispatch.ALL)
    def forward_backward(
        self,
        rollouts: Rollouts,
        advantages: Tensor | Advantages,
        *,
        loss_fn: PolicyLoss,
        normalizer: Tensor | float | None = None,
    ) -> dict[str, float]:
        """Add ∇_θ Σ_{i,t} ℓ_{i,t} / n to the gradients (Tinker's ``forward_backward``):
        the first half of a ``step`` mini-batch, per micro-batch forward, per-token ``loss_fn``,
        ``aggregate`` with n, backward; gradients accumulate until :meth:`optim_step`.

        n defaults to ``config.aggregation.normalizer`` of *this call's* response mask: k calls
        over k chunks of one batch must pass the whole batch's :meth:`normalizer`, so that
        their gradient is the batch's. ``advantages``, ``loss_fn`` and π_ref are as in
        :meth:`step`; π_old is ``rollouts.old_logprobs``, else the
        detached log-probs of this forward (no weight moved since the last ``optim_step``).
        Returns this call's ``loss`` (Σ over its micro-batches and ranks: with the batch's n,
        the calls' losses add up to ``step``'s), its token-weighted loss metrics and
        ``entropy``, and the ``mismatch/*`` metrics. In a data-parallel group every rank gets
        the whole call and takes its share. A call that fails part-way drops every pending
        gradient; while any is pending, ``step``, ``state_dict`` and ``save_checkpoint`` refuse.
        """
        norm = None if normalizer is None else torch.as_tensor(normalizer, dtype=torch.float64)
        if norm is not None and norm.ndim != 0:
            raise ValueError(
                f"PolicyTrainer.forward_backward: normalizer must be a scalar, got shape "
                f"{tuple(norm.shape)}; pass a float or a 0-d tensor (PolicyTrainer.normalizer)"
            )
        everything = [torch.arange(len(rollouts))]
        method = "forward_backward"
        update = self._update(rollouts, advantages, loss_fn, everything, method)
        if norm is not None:
            update.work = dataclasses.replace(update.work, norms=[norm.to(self.device)])
        metrics = self._accumulation.add(self, update.work, update.loss)
        return {**update.mismatch(self.dp), **metrics}

    @dispatch(Dispatch.ALL)
    def optim_step(self) -> dict[str, float]:
        """Apply what :meth:`forward_backward` accumulated since the last call (Tinker's
        ``optim_step``), as at the end of a ``step`` mini-batch: NaN guard over all of it (one
        decision for every rank), clip, AdamW, schedule, counters, gradients zeroed. Returns
        ``grad_norm`` (pre-clipping; NaN when skipped), ``lr`` (of this update),
        ``optimizer_steps`` and ``skipped_steps`` (1.0 or 0.0). ``RuntimeError`` when nothing
        was accumulated."""
        return self._accumulation.apply(self)

    @dispatch(Dispatch.ALL)
    def normalizer(self, rollouts: Rollouts) -> Tensor:
        """``config.aggregation.normalizer`` of the batch's response mask: a float32 scalar, the
        n every :meth:`forward_backward` call over a chunk of this batch must pass."""
        return self.config.aggregation.normalizer(rollouts.response_mask)

    def _update(
        self,
        rollouts: Rollouts,
        advantages: Tensor | Advantages,
        loss_fn: PolicyLoss,
        minibatches: Sequence[Tensor] | None,
        method: str,
    ) -> PreparedUpdate:
        """This rank's part of an update, ready for the loop (``rlblocks.trainer.policy_loss``)."""
        self._check_layout(method)
        rollouts.known_lengths()  # read on the host copy: the device copy inherits them
        batch = rollouts.to(self.device)
        batch = batch.replace(advantages=token_advantages(advantages, batch))
        has_ref = self.reference is not None or self._adapter_reference
        return prepare_update(
            assign(self, batch, minibatches, method=method),
            loss_fn,
            config=self.config,
            score=partial(score, self, self.model),
            score_old=lambda ro: score_no_grad(self, self.model, ro, replay=True)[0],
            score_ref=partial(ref_scores, self) if has_ref else None,
        )

    # ------------------------------------------------------------------ weights and state
    def named_weights(self, *, bucket_bytes: int | None = None) -> Iterator[tuple[str, Tensor]]:
        """Full weights under the Hugging Face names of ``model.state_dict()`` (tied ones under
        each name), for a resharder (``rlblocks.trainer.weights.full_weights``): the model's own
        tensors (no copy: copy them to keep them past the next step); with LoRA, W + scaling ·
        B·A in new tensors, the model untouched. Sharded (FSDP) trainers all-gather them in
        collectives of about ``bucket_bytes``; every rank must iterate to the end."""
        yield from full_weights(
            self.model, self.dp, adapter=self.has_adapter, bucket_bytes=bucket_bytes
        )

    def weight_spec(self) -> dict[str, TensorSpec]:
        """Name -> (shape, dtype) of :meth:`named_weights`, from metadata: nothing gathered."""
        return full_weight_spec(self.model, adapter=self.has_adapter)

    def save_adapter(self, folder: str | Path) -> None:
        """Write the LoRA adapter (peft's ``save_pretrained``: adapter weights and config, no
        base weights) into ``folder``, for an engine that serves adapters itself. A sharded
        trainer gathers the adapters first: every rank of its group must call (each writes its
        own ``folder``, for the engine beside it)."""
        save_adapter(self, folder)

    @dispatch(Dispatch.ALL)
    def save_pretrained(
        self, folder: str | Path, *, merge_lora: bool = True, **options: Any
    ) -> Path:
        """Export a Hugging Face folder (``rlblocks.trainer.export.save_pretrained``): full model
        (LoRA merged), or peft's adapter with ``merge_lora=False``; tokenizer and generation
        config too. Every data-parallel rank must call; rank 0 writes, atomically."""
        return save_pretrained(self, folder, merge_lora=merge_lora, **options)

    @dispatch(Dispatch.ALL)
    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = DEFAULT_COMMIT_MESSAGE,
        merge_lora: bool = True,
        **options: Any,
    ) -> Any:
        """``save_pretrained`` into a temporary folder, uploaded to the Hugging Face hub by rank 0
        (``rlblocks.trainer.export.push_to_hub``): its ``CommitInfo`` on rank 0, else None."""
        return push_to_hub(
            self,
            repo_id,
            private=private,
            token=token,
            commit_message=commit_message,
            merge_lora=merge_lora,
            **options,
        )

    @dispatch(Dispatch.ALL)
    def save_checkpoint(self, folder: str | Path) -> None:
        """This trainer's part of a run checkpoint (`rlblocks.trainer.checkpoint`): the model in
        the Hugging Face format in ``folder/model``, optimizer (sharded), scheduler, counters,
        random state, the reference's fingerprint. Every rank calls it with the same folder;
        refused while ``forward_backward`` gradients are pending (they are not saved)."""
        self._accumulation.refuse(self, "save_checkpoint")
        save_weights(self, Path(folder) / "model")
        save_trainer(self, folder, model_state=False, frozen=reference_tensors(self))

    @dispatch(Dispatch.ALL)
    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore :meth:`save_checkpoint`'s folder onto any number of ranks (same reference);
        pending ``forward_backward`` gradients are dropped (they belong to other weights)."""
        self._accumulation.drop(self)
        load_weights(self, Path(folder) / "model")
        load_trainer(self, folder, model_state=False, frozen=reference_tensors(self))

    def state_dict(self) -> dict[str, Any]:
        """Trainable parameters, optimizer, scheduler, counters and the process's random state
        (`rlblocks.base.rng`). References, not copies: ``copy.deepcopy`` it to keep a
        snapshot while training goes on.

        Sharded (data-parallel) trainers return the full, unsharded state on every rank, with
        the optimizer state keyed by parameter name; it loads into a group of any size.
        Refused while ``forward_backward`` gradients are pending (they are not part of it).
        """
        self._accumulation.refuse(self, "state_dict")
        return policy_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the next ``step`` then matches the original.
        The state of a trainer in one process loads into a sharded group (Ray workers) and the
        other way round. Pending ``forward_backward`` gradients are dropped (they belong to
        other weights)."""
        self._accumulation.drop(self)
        load_policy_state(self, state)
