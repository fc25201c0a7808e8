"""The state of a ``PolicyTrainer`` beyond its step: sharding it into a data-parallel group, its
whole state as a dict and back, and its LoRA adapter on disk. Functions of the trainer, kept
here so that ``rlblocks.trainer.policy`` reads as the update itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlblocks.base.rng import rng_state, set_rng_state
from rlblocks.models.regional import compile_blocks
from rlblocks.trainer.config import apply_config
from rlblocks.trainer.fsdp import full_state, full_tensor, load_full_state, shard_modules
from rlblocks.trainer.weights import load_trainable_state, optimizer_state_by_name, trainable_state


def shard_policy(trainer: Any, group: Any) -> None:
    """``PolicyTrainer.shard``: the checks, FSDP2 (and tp/sp) over ``group``, the compiled
    blocks kept, the optimizer rebuilt on the shards, a chosen token budget chosen again."""
    if trainer.optimizer_steps:
        raise RuntimeError(
            f"PolicyTrainer.shard: the trainer has already taken {trainer.optimizer_steps} "
            "optimizer steps; shard a trainer right after building it"
        )
    if trainer.dp.sharded:
        raise RuntimeError("PolicyTrainer.shard: the trainer is already sharded; call shard once")
    if trainer.has_adapter and (trainer.config.tp > 1 or trainer.config.sp > 1):
        kind = "tensor" if trainer.config.tp > 1 else "sequence"
        raise NotImplementedError(
            f"PolicyTrainer.shard: a LoRA policy cannot be {kind} parallel (tp = "
            f"{trainer.config.tp}, sp = {trainer.config.sp}): peft's adapter layers wrap the "
            "projections the plan splits; train LoRA data parallel (tp=1, sp=1), or "
            "fine-tune all weights"
        )
    trainer.dp = shard_modules(
        group,
        trainer.config.fsdp,
        trainable=trainer.model,
        frozen=[trainer.reference],
        tp=trainer.config.tp,
        sp=trainer.config.sp,
    )
    if trainer.config.compile:  # FSDP2 swaps the blocks' classes: their forwards stay compiled
        compile_blocks(trainer.model, owner="PolicyTrainer")
    trainer.rebuild_optimizer()
    if trainer._chosen_budget:  # sharded: each rank holds less; the group takes the smallest
        trainer.config = dataclasses.replace(trainer.config, micro_batch_tokens=None)
        trainer._fit_token_budget()
        budget = trainer.config.micro_batch_tokens
        assert budget is not None  # chosen again
        smallest = -int(trainer.dp.all_max(-float(budget)))
        trainer.config = dataclasses.replace(trainer.config, micro_batch_tokens=smallest)


def save_adapter(trainer: Any, folder: str | Path) -> None:
    """``PolicyTrainer.save_adapter``: peft's adapter files, gathered first when sharded."""
    if not trainer.has_adapter:
        raise ValueError(
            "PolicyTrainer.save_adapter: the policy has no LoRA adapter; build it with "
            "lora=LoraConfig(...), or save the full model with save_pretrained"
        )
    state = None
    if trainer.dp.sharded:  # the adapters' shards made whole: every rank of the group calls
        state = {
            name: full_tensor(value).detach()
            for name, value in trainer.model.state_dict().items()
            if ".lora_" in name
        }
    trainer.model.save_pretrained(folder, state_dict=state)


def policy_state(trainer: Any) -> dict[str, Any]:
    """``PolicyTrainer.state_dict``: trainable parameters, optimizer, schedule, counters, random
    state (full and keyed by name when sharded)."""
    counters = {k: getattr(trainer, k) for k in ("steps", "optimizer_steps", "skipped_steps")}
    if trainer.dp.sharded:
        model, optimizer = full_state(trainer.model, trainer.optimizer)
    else:
        model, optimizer = dict(trainable_state(trainer.model)), trainer.optimizer.state_dict()
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": trainer.scheduler.state_dict(),
        "counters": counters,
        "rng": rng_state(),
    }


def load_policy_state(trainer: Any, state: Mapping[str, Any]) -> None:
    """``PolicyTrainer.load_state_dict``: what :func:`policy_state` saved, into one process or a
    sharded group; the trainer's own configuration applied again."""
    if trainer.dp.sharded:
        optim = optimizer_state_by_name(trainer.optimizer, trainer.model, state["optimizer"])
        load_full_state(trainer.model, trainer.optimizer, state["model"], optim)
    else:
        load_trainable_state(trainer.model, state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    apply_config(trainer.optimizer, trainer.scheduler, trainer.config)  # its own lr, schedule, ...
    for name, value in state["counters"].items():
        setattr(trainer, name, int(value))
    set_rng_state(state["rng"])
