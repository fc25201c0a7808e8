"""``CriticTrainer``: a :class:`ValueModel` and its AdamW optimizer, regressed on returns.

One :meth:`CriticTrainer.step` is the critic half of a PPO update (verl's ``update_critic``,
OpenRLHF's ``CriticPPOTrainer.training_step``), batched exactly like
:class:`~rlblocks.trainer.PolicyTrainer` and configured by the same
:class:`~rlblocks.trainer.TrainConfig` (``temperature`` and ``logprob_chunk_size`` do not apply):

1. ``old_values``: given, or ``rollouts.old_values``, or scored now without gradient,
   before any update (the values the advantages were computed with).
2. Epochs × shuffled mini-batches (``rlblocks.trainer.batches.minibatch_rows``, seeded by
   ``(config.shuffle_seed, number of step calls)``); per mini-batch the normalizer
   ``config.aggregation.normalizer(mask)`` once, per micro-batch forward, per-token
   :func:`rlblocks.losses.value_loss`, ``aggregate`` with that normalizer, backward.
3. Clip the gradient norm, AdamW step, scheduler step. A non-finite loss or gradient norm skips
   the update (weights, optimizer state and schedule untouched) with a ``RuntimeWarning``.

Steps 2 and 3 are the policy trainer's loop (``rlblocks.trainer.update``); this class supplies
the value loss of one micro-batch. In a data-parallel group it shards itself like the policy
(:meth:`CriticTrainer.shard`).

The value model trains in ``train()`` mode and scores in ``eval()`` mode (no dropout in LLMs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlblocks.critic.value_model import ValueModel
from rlblocks.interfaces import Advantages, Dispatch, dispatch
from rlblocks.losses.aggregate import aggregate
from rlblocks.losses.value import value_loss
from rlblocks.rollouts import Rollouts
from rlblocks.trainer.batches import scored_in_pieces, token_advantages
from rlblocks.trainer.checkpoint import load_trainer, save_trainer
from rlblocks.trainer.config import TrainConfig, apply_config
from rlblocks.trainer.fsdp import full_state, load_full_state, shard_modules
from rlblocks.trainer.parallel import DataParallel, SingleProcess
from rlblocks.trainer.update import Trained, assign, run_update, start_training


class CriticTrainer(Trained):
    """A value model and its optimizer; ``step`` fits V to the returns with PPO's value loss.

    ``model``: a :class:`ValueModel`, or a causal LM (a policy's or reward model's) that is
    wrapped as ``ValueModel(model)``: backbone copied, zero-initialised head. ``config`` and
    ``config_overrides`` as for ``PolicyTrainer`` (``CriticTrainer(model, lr=1e-5)``).
    """

    def __init__(
        self, model: nn.Module, *, config: TrainConfig | None = None, **config_overrides: Any
    ) -> None:
        self.config = dataclasses.replace(config or TrainConfig(), **config_overrides)
        if not isinstance(model, ValueModel):
            model = ValueModel(model)
        if self.config.gradient_checkpointing:
            model.backbone.gradient_checkpointing_enable(  # type: ignore[operator]  # Module.__getattr__ is typed Tensor | Module
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.model = model.eval()
        self.dp: SingleProcess | DataParallel = SingleProcess()  # see shard()
        start_training(self)  # counters steps, optimizer_steps, skipped_steps; the optimizer

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        init_std: float = 0.0,
        attn_implementation: str | None = None,
        rope_scaling: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> CriticTrainer:
        """A critic on the backbone of a checkpoint loaded by ``rlblocks.models.load``.

        ``device``: None is CUDA when torch sees a GPU, else the CPU; a device torch does not
        see is refused, naming ``CriticTrainer.from_pretrained``, before any weight is read.
        ``attn_implementation``, ``rope_scaling``, ``model_config``: ``load``'s overrides of
        the checkpoint's configuration."""
        from rlblocks.models import load, resolve_device

        device = resolve_device(device, owner=f"{cls.__name__}.from_pretrained")
        model, _ = load(name_or_path, dtype=dtype, device=device,
                        attn_implementation=attn_implementation, rope_scaling=rope_scaling,
                        model_config=model_config)  # fmt: skip
        # the loaded model is the critic's own, so its backbone is not copied
        return cls(ValueModel(model, init_std=init_std, copy=False), **kwargs)

    @property
    def device(self) -> torch.device:
        """The device of the value model's parameters."""
        return next(self.model.parameters()).device

    def shard(self, group: Any = None) -> None:
        """Join a data-parallel group (``Shardable``): FSDP2 over ``group`` unless it has one
        process and ``config.fsdp`` is None (``rlblocks.trainer.fsdp.shard_modules``)."""
        if self.optimizer_steps:
            raise RuntimeError(
                f"CriticTrainer.shard: the critic has already taken {self.optimizer_steps} "
                "optimizer steps; shard a critic right after building it"
            )
        if self.dp.sharded:
            raise RuntimeError(
                "CriticTrainer.shard: the critic is already sharded; call shard once"
            )
        if self.config.tp > 1 or self.config.sp > 1:
            raise NotImplementedError(
                f"CriticTrainer.shard: tensor and sequence parallelism (tp = {self.config.tp}, "
                f"sp = {self.config.sp}) are built for the policy only; shard the critic data "
                "parallel (tp=1, sp=1)"
            )
        self.dp = shard_modules(group, self.config.fsdp, trainable=self.model)
        self.rebuild_optimizer()

    # ------------------------------------------------------------------ scoring (no grad)
    @dispatch(Dispatch.ROWS)
    @torch.no_grad()
    def values(self, rollouts: Rollouts) -> Tensor:
        """V(s_k) of every response token (see :class:`ValueModel`) under the current weights.

        Returns ``(b t)`` float32, 0 where ``response_mask`` is False, no grad, on the device of
        ``rollouts``. Micro-batched like a training step, each micro-batch trimmed of unused
        padding.
        """
        home = rollouts.response_ids.device
        rollouts = rollouts.to(self.device)
        b, t = rollouts.response_ids.shape
        if b == 0 and self.dp.size == 1:
            return torch.zeros(b, t, device=home)
        score = lambda micro: (self._forward(micro),)
        (values,) = scored_in_pieces(score, rollouts, self.config, self.dp)
        assert values is not None  # _forward always gives values
        return values.float().to(home)

    def _forward(self, rollouts: Rollouts) -> Tensor:
        return self.model(rollouts, bf16=bool(self.config.bf16), packing=self.config.packing)

    # ------------------------------------------------------------------ the update
    @dispatch(Dispatch.ALL)
    def step(
        self,
        rollouts: Rollouts,
        returns: Tensor | Advantages,
        *,
        old_values: Tensor | None = None,
        clip: float | None = 0.2,
        minibatches: Sequence[Tensor] | None = None,
    ) -> dict[str, float]:
        """One critic update: epochs × mini-batches × micro-batches (module docstring).

        Per mini-batch M: φ ← AdamW(φ, clip(∇_φ Σ_{micro ⊂ M} Σ_{i,k} L_{i,k} / n(M))) with
        L_{i,k} = ½ max((V_φ − R)², (clip(V_φ, V_old − ε, V_old + ε) − R)²) from
        :func:`rlblocks.losses.value_loss` (ε = ``clip``; ``None`` = plain ½ (V − R)²) and
        n(M) = ``config.aggregation.normalizer(mask_M)``. PPO's value loss: Schulman et al.
        2017, arXiv 1707.06347, eq. 9; value clipping as in the OpenAI baselines PPO2 code.

        ``returns``: ``(b t)`` (or ``(b)``, broadcast over each row's valid tokens) regression
        targets, or an ``Advantages`` tuple whose ``returns`` are used; detached.
        ``old_values``: ``(b t)`` detached; see the module docstring for the default.

        Returns floats: ``vf_loss`` (mean mini-batch loss), ``vf_clip_frac`` and ``values_mean``
        (token-weighted over micro-batches), ``vf_explained_var`` (1 − Var(R − V_old) / Var(R)
        over the whole batch, before the update: how well the critic predicted these returns;
        NaN for constant returns), ``vf_grad_norm`` (mean pre-clipping norm), ``vf_lr``,
        ``vf_optimizer_steps``, ``vf_skipped_steps`` and ``vf_seconds``. Metrics of skipped
        updates are left out (NaN if every update was skipped).

        ``minibatches``: row indices of each optimizer step, instead of the configured
        shuffling. In a data-parallel group every rank gets the whole batch, trains on its share
        and returns the metrics of the whole group, as ``PolicyTrainer.step`` does.
        """
        start = time.perf_counter()
        batch = rollouts.to(self.device)
        if isinstance(returns, Advantages):
            returns = returns.returns
        # token_advantages does the (b) / (b t) shape handling, masking and detaching we need.
        batch = batch.replace(returns=token_advantages(returns, batch))
        if old_values is not None:
            batch = batch.replace(old_values=old_values.to(self.device))
        work = assign(self, batch, minibatches)
        if work.batch.old_values is None:  # the values the advantages were computed with
            local = work.batch.replace(old_values=self.values(work.batch))
            work = dataclasses.replace(work, batch=local)
        owned = work.batch.select(work.owned)
        assert owned.old_values is not None and owned.returns is not None  # both set above
        explained_var = _explained_variance(
            owned.old_values, owned.returns, owned.response_mask, self.dp
        )
        summary = run_update(self, work, partial(self._micro_loss, clip=clip))
        return {
            "vf_loss": summary["loss"],
            "vf_clip_frac": summary.get("vf_clip_frac", float("nan")),
            "vf_explained_var": explained_var,
            "values_mean": summary.get("values_mean", float("nan")),
            "vf_grad_norm": summary["grad_norm"],
            "vf_lr": summary["lr"],
            "vf_optimizer_steps": summary["optimizer_steps"],
            "vf_skipped_steps": summary["skipped_steps"],
            "vf_seconds": self.dp.all_max(time.perf_counter() - start),  # the slowest rank
        }

    def _micro_loss(
        self, micro: Rollouts, normalizer: Tensor, *, clip: float | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch: value forward, per-token clipped value loss, ``aggregate``."""
        mask = micro.response_mask
        assert micro.old_values is not None and micro.returns is not None  # set by step
        per_token, metrics = value_loss(
            self._forward(micro), micro.old_values, micro.returns, mask, clip=clip
        )
        loss = aggregate(per_token, mask, mode=self.config.aggregation, normalizer=normalizer)
        metrics.pop("vf_explained_var")  # reported once per batch (in step), over every row
        return loss, metrics

    # ------------------------------------------------------------------ state
    @dispatch(Dispatch.ALL)
    def save_checkpoint(self, folder: str | Path) -> None:
        """This critic's part of a run checkpoint (``rb.checkpoint``): value model and
        optimizer sharded, scheduler, counters, random state (`rlblocks.trainer.checkpoint`).
        Every rank of a sharded critic calls it with the same folder."""
        save_trainer(self, folder, model_state=True, frozen=())

    @dispatch(Dispatch.ALL)
    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote, onto any number of ranks."""
        load_trainer(self, folder, model_state=True, frozen=())

    def state_dict(self) -> dict[str, Any]:
        """Value model (backbone and head), optimizer, scheduler and counters (references, not
        copies: ``copy.deepcopy`` it to keep a snapshot while training goes on)."""
        counters = {k: getattr(self, k) for k in ("steps", "optimizer_steps", "skipped_steps")}
        if self.dp.sharded:  # full, unsharded state on every rank
            model, optimizer = full_state(self.model, self.optimizer)
        else:
            model, optimizer = self.model.state_dict(), self.optimizer.state_dict()
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "counters": counters,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the next ``step`` then matches the original."""
        if self.dp.sharded:
            load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        apply_config(self.optimizer, self.scheduler, self.config)  # its own lr, schedule, ...
        for name, value in state["counters"].items():
            setattr(self, name, int(value))


def _explained_variance(
    values: Tensor, returns: Tensor, mask: Tensor, dp: SingleProcess | DataParallel
) -> float:
    """1 − Var(R − V) / Var(R) over the valid tokens of the whole batch (all ranks).

    Both variances have the same n − 1, so the ratio is Σ(d − d̄)² / Σ(R − R̄)² with d = R − V,
    computed from five float64 sums that add up over ranks. NaN when the returns are constant.
    """
    m = mask.double()
    r, d = returns.double() * m, (returns.double() - values.double()) * m
    sums = dp.all_sum(torch.stack([m.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()]))
    n, sr, srr, sd, sdd = sums.tolist()
    ss_returns = srr - sr * sr / max(n, 1.0)
    ss_residual = sdd - sd * sd / max(n, 1.0)
    constant = ss_returns <= 1e-12 * srr  # zero up to the rounding of the sums
    return float("nan") if constant else 1.0 - ss_residual / ss_returns
