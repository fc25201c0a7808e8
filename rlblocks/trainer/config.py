"""``TrainConfig``: every knob of :class:`~rlblocks.trainer.PolicyTrainer`, one dataclass.

One frozen dataclass, each field with a one-line docstring (cleanrl style). Override fields with
keywords: ``PolicyTrainer(model, lr=1e-5, epochs=2)`` is
``PolicyTrainer(model, config=dataclasses.replace(TrainConfig(), lr=1e-5, epochs=2))``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from rlblocks.interfaces import Aggregation
from rlblocks.losses.aggregate import token_mean
from rlblocks.losses.entropy import DEFAULT_CHUNK_SIZE
from rlblocks.trainer.fsdp import FSDP
from rlblocks.trainer.schedules import constant


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer, batching and numerics of a policy update."""

    lr: float = 1e-6
    """AdamW learning rate (the base; ``schedule`` multiplies it)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates (β1, β2)."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    schedule: Callable[[int], float] | None = None
    """Multiplier of ``lr`` per optimizer step (see ``rlblocks.trainer.schedules``); None = 1."""
    max_grad_norm: float | None = 1.0
    """Clip the total gradient norm to this before each optimizer step; None = no clipping."""
    mini_batch_size: int | None = None
    """Rows per optimizer step; None = the whole batch is one mini-batch."""
    epochs: int = 1
    """PPO epochs: passes over the batch, each in a fresh shuffled mini-batch order."""
    micro_batch_size: int | None = None
    """Rows per forward/backward (gradient accumulation); None = the whole mini-batch."""
    micro_batch_tokens: int | None = None
    """Or a budget of real tokens per forward/backward (``Rollouts.split(token_budget=)``). On
    a GPU with neither this nor ``micro_batch_size`` set, the trainer takes the largest budget
    its free memory holds (``rlblocks.planner.budget``) and prints why."""
    aggregation: Aggregation = token_mean
    """How a per-token loss becomes a scalar (``rlblocks.losses`` modes)."""
    temperature: float = 1.0
    """Logits are divided by it before the log-softmax, as in the rollout engine's sampling."""
    bf16: bool | None = None
    """Run forward passes under ``torch.autocast(dtype=torch.bfloat16)``: bf16 matmuls over
    float32 parameters, AdamW state and master weights, log-probs and loss reductions in
    float32. None (default): on for a float32 model on a GPU that has bf16, off elsewhere
    (``rlblocks.trainer.numerics.resolve_numerics``); True on a GPU without bf16 is refused."""
    compile: bool | None = None
    """Compile each decoder block (``rlblocks.models.regional``: ``torch.compile`` per block,
    forward and backward, every token count one graph). None (default): on a GPU, off on the
    CPU, where inductor's first compile costs more than a short run wins back
    (``docs/speed.md``); True on the CPU compiles too. Not with ``tp`` or ``sp`` > 1."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (``model.gradient_checkpointing_enable``)."""
    log_entropy: bool = False
    """Report ``entropy``, the mean entropy of the policy's next-token distributions over the
    response tokens, from every update; it costs one more float32 pass over the vocabulary per
    token (about 5% of a SmolLM2-135M update on a CPU). A loss that takes ``entropy`` gets it
    and reports it regardless."""
    logprob_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Tokens per chunk of the vocabulary projection and float32 log-softmax / entropy (bounds
    their memory: ``chunk × vocabulary`` logits at a time)."""
    packing: bool = True
    """Run every scoring and training forward padding-free: each micro-batch's real tokens as
    one sequence, attention kept within each row (``rlblocks.trainer.packing``); False:
    right-padded rows, every padding column computed."""
    shuffle_seed: int = 0
    """Seed of the mini-batch shuffling; the order depends on (seed, trainer step) only."""
    fsdp: FSDP | None = None
    """How ``shard`` shards the model in a data-parallel group (``rlblocks.trainer.FSDP``);
    None: FSDP2 with defaults in a group of several processes, unsharded in a group of one.
    An ``FSDP(...)`` shards a group of one too (mixed precision or CPU offload there)."""

    tp: int = 1
    """Tensor-parallel size: ``shard`` splits every layer over groups of ``tp`` consecutive
    ranks (``rlblocks.trainer.tensor_parallel``; the model's own plan), data parallel across
    the groups: a world of W processes is a ``(W / tp) × tp`` mesh. 1: data parallel only."""
    sp: int = 1
    """Sequence-parallel size: ``shard`` gives each group of ``sp`` consecutive ranks the same
    rows, and each rank of a group a contiguous slice of every packed micro-batch's tokens,
    attention crossing the slices by two all-to-alls per layer (Ulysses,
    ``rlblocks.models.ulysses``); FSDP2 over every rank. Needs ``packing``; not with ``tp``."""

    def __post_init__(self) -> None:
        positive = {
            "tp": self.tp,
            "sp": self.sp,
            "mini_batch_size": self.mini_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "micro_batch_tokens": self.micro_batch_tokens,
            "epochs": self.epochs,
            "logprob_chunk_size": self.logprob_chunk_size,
        }
        for name, value in positive.items():
            if value is not None and value < 1:
                raise ValueError(
                    f"TrainConfig.{name}: must be >= 1 or None, got {value}; pass a positive count"
                )
        if self.sp > 1 and self.tp > 1:
            raise ValueError(
                f"TrainConfig.sp: sequence parallelism (sp = {self.sp}) with tensor parallelism "
                f"(tp = {self.tp}) is not built; use one of them"
            )
        if self.sp > 1 and not self.packing:
            raise ValueError(
                f"TrainConfig.sp: sequence parallelism (sp = {self.sp}) splits packed "
                "micro-batches; keep packing=True"
            )
        if self.sp > 1 and self.gradient_checkpointing:
            raise ValueError(
                f"TrainConfig.sp: sequence parallelism (sp = {self.sp}) does not run with "
                "gradient checkpointing (the recomputed layers would lose its attention); turn "
                "one of them off"
            )
        if self.compile and (self.tp > 1 or self.sp > 1):
            kind = "tensor" if self.tp > 1 else "sequence"
            raise ValueError(
                f"TrainConfig.compile: compiled decoder blocks with {kind} parallelism (tp = "
                f"{self.tp}, sp = {self.sp}) are not built (their DTensor layers and attention "
                "are not traced); pass compile=False, or tp=1 and sp=1"
            )
        self._check_numbers()

    def _check_numbers(self) -> None:
        """Every float setting is a finite number in its range (a NaN passes every ``<``
        comparison: ``max_grad_norm=nan`` would turn every weight NaN in the first step)."""
        ranges = {  # name: (value, lowest, whether the lowest is allowed, highest excluded)
            "lr": (self.lr, 0.0, True, None),
            "weight_decay": (self.weight_decay, 0.0, True, None),
            "eps": (self.eps, 0.0, False, None),
            "temperature": (self.temperature, 0.0, False, None),
            "max_grad_norm": (self.max_grad_norm, 0.0, False, None),
            "betas[0]": (self.betas[0], 0.0, True, 1.0),
            "betas[1]": (self.betas[1], 0.0, True, 1.0),
        }
        for name, (value, low, closed, high) in ranges.items():
            if value is None and name == "max_grad_norm":
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and _within(float(value), low, closed, high)):  # type: ignore[arg-type]
                bound = f"{'>=' if closed else '>'} {low:g}" + (f" and < {high:g}" if high else "")
                fix = ", or None for no clipping" if name == "max_grad_norm" else ""
                raise ValueError(
                    f"TrainConfig.{name}: must be a finite number {bound}, got {value!r}; pass "
                    f"a value in that range{fix}"
                )


def _within(value: float, low: float, closed: bool, high: float | None) -> bool:
    """``value`` is finite, above ``low`` (or equal to it when ``closed``) and below ``high``."""
    above = value >= low if closed else value > low
    return math.isfinite(value) and above and (high is None or value < high)


def adamw(params: list[nn.Parameter], config: TrainConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with ``config``'s lr, betas, eps and weight decay; the fused kernel
    (one pass per tensor, not one op per step of the update rule) where torch has it: plain
    tensors on a CPU or a GPU. On one CPU thread it takes SmolLM2-135M's update from ~0.39 s
    to ~0.09 s. Sharded (DTensor) parameters keep the default implementation."""
    fused = all(
        type(p) is nn.Parameter and p.device.type in ("cpu", "cuda") and p.is_floating_point()
        for p in params
    )
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=fused or None,
    )


def optimizer_and_schedule(
    model: nn.Module, config: TrainConfig, *, owner: str
) -> tuple[torch.optim.AdamW, LambdaLR]:
    """A fresh :func:`adamw` on ``model``'s trainable parameters and its ``LambdaLR`` with
    ``config.schedule`` (constant when None): what a trainer builds at first and again after
    sharding. ``owner`` names the trainer in the error raised when nothing is trainable."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(
            f"{owner}: the model has no parameter with requires_grad; unfreeze the parameters "
            "to train (or attach a LoRA adapter)"
        )
    optimizer = adamw(trainable, config)
    # A copy: LambdaLR.load_state_dict writes the saved schedule's fields into the object it
    # holds, and config.schedule must stay what the user built (apply_config reads it).
    return optimizer, LambdaLR(optimizer, copy.copy(config.schedule or constant()))


def apply_config(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, config: TrainConfig
) -> None:
    """Put ``config`` back in effect on an optimizer and its schedule whose state was just
    loaded (a resumed run): without it the saved ``lr``, ``betas``, ``eps``, ``weight_decay``
    and ``schedule`` would win over the ones the trainer was built with, silently.

    What is state stays: AdamW's moments and step counts, and k, the optimizer steps the
    schedule has taken. What is configuration is the trainer's: every parameter group gets
    ``config``'s betas, eps and weight decay, the schedule becomes ``config.schedule`` with
    ``config.lr`` as its base, and the learning rate in effect is ``lr · schedule(k)``, as in a
    run that had used them from the start. So a run resumed with another ``lr`` goes on where
    its schedule was, with the new peak (after warmup: the new lr; in a cosine decay: the new
    lr times the decay reached), and a new schedule is read at the same k.
    """
    schedule = config.schedule or constant()
    done = scheduler.last_epoch  # the guard steps the schedule with every applied update
    scheduler.lr_lambdas = [copy.copy(schedule) for _ in optimizer.param_groups]
    scheduler.base_lrs = [config.lr for _ in optimizer.param_groups]
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["initial_lr"] = base
        group["lr"] = base * factor(done)  # LambdaLR.get_lr's own expression
        group["betas"], group["eps"] = tuple(config.betas), config.eps
        group["weight_decay"] = config.weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # get_last_lr()
