"""``rb.plan``: the bytes a run needs per device, by part, before anything is loaded.

The model is sized on the meta device (:mod:`rlblocks.planner.shapes`); the rest is arithmetic
over how rlblocks trains and samples, part by part, per device:

- **weights**: parameters × dtype bytes, split over ``tp`` and FSDP's shards (``world / tp``
  ranks); with FSDP (more than one shard) two whole layers more, the one being computed and the
  one gathered ahead.
- **reference**: the frozen copy a full model keeps for KL (``PolicyTrainer(reference="auto")``
  makes one; LoRA uses the adapter-disabled model and keeps none), sharded like the weights.
- **gradients**, **optimizer**: trainable parameters × dtype bytes, × 2 moments for AdamW (0 for
  SGD), sharded like the weights. torch's AdamW keeps its moments in the parameters' dtype.
- **activations**: the tokens of one forward on this rank (``tokens / sp``) × what each layer
  saves per token (the meta trace, which sees the model's own attention and LoRA's inputs) ×
  layers, and one layer's worth more: the gradients of a layer's saved tensors while its
  backward runs. With gradient checkpointing each layer keeps only its input (hidden × dtype
  bytes per token) and one layer is recomputed at a time. Under tensor parallelism the tensors
  of hidden width stay whole and the rest split ``tp`` ways.
- **logits**: rlblocks never holds a forward's ``tokens × vocabulary`` logits: the head runs in
  chunks of ``logprob_chunk_size`` tokens, in float32, and the backward recomputes a chunk at a
  time: logits, their softmax and their gradient, 3 × chunk × vocabulary / tp × 4 bytes.
- **kv cache**: the engine's keys and values, as its memory model says (``memory_model()``,
  `rlblocks.interfaces.EngineMemory`; the planner never tests an engine's class): ``"rows"``,
  rows × (prompt + response tokens) × layers × key and value width × dtype bytes (the HF
  engine); ``"pool"``, ``gpu_memory_utilization`` of the device whatever the batch, its weights
  and cache pool together (vLLM).
- **engine copy**: the engine's own weights when it does not sample with the trainer's model
  (vLLM always; an HF engine given a copy, e.g. for rollouts k steps off).

Phases share a device when the engine is colocated: the training phase holds the trainer's
parts and whatever the engine keeps meanwhile (all of it, or nothing with vLLM's sleep mode);
the sampling phase holds the trainer's resident parts (weights, reference, optimizer: rlblocks
frees gradients after each optimizer step) and the engine's. The device's peak is the larger.

What the arithmetic leaves out (and the validation benchmark measures with it): the CUDA
context and allocator caching on a GPU, the Python process on a CPU, the optimizer's
temporaries. ``MARGIN`` of the device is kept free for them in the verdict.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from rlblocks.interfaces import EngineMemory, SizedEngine
from rlblocks.planner.shapes import ModelShape, model_shape

MARGIN = 0.10
"""Share of the device the verdict keeps free (allocator caching, context, temporaries)."""
GIB = 1024**3
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}
TRAIN_PARTS = ("weights", "reference", "gradients", "optimizer", "activations", "logits")
ENGINE_PARTS = ("engine copy", "kv cache")
DEFAULT_ENGINE = EngineMemory("hf")
"""What ``plan`` sizes when no engine is named: one sampling with the trainer's module, keys
and values per row (``HFEngine.memory_model()``)."""


@dataclass(frozen=True)
class Setup:
    """What :func:`plan` sized (its arguments, resolved)."""

    dtype: torch.dtype
    optimizer: str
    lora: bool
    reference: bool
    gradient_checkpointing: bool
    tokens: int
    logprob_chunk_size: int
    world: int
    tp: int
    sp: int
    engine: EngineMemory | None
    rollout_rows: int
    rollout_tokens: int
    engine_copy: bool
    colocated: bool
    sleep: bool
    gpu_memory_utilization: float
    autocast: bool = False
    """bf16 autocast over parameters of ``dtype``: activations and the head's hidden states in
    bf16, weights, gradients and AdamW state in ``dtype`` (``TrainConfig.bf16``)."""

    @property
    def compute(self) -> torch.dtype:
        """The dtype of the activations: bf16 under autocast, else ``dtype``."""
        return torch.bfloat16 if self.autocast else self.dtype


@dataclass(frozen=True)
class Plan:
    """Bytes per device by part, the peak and the verdict (:func:`plan`).

    ``trainer`` and ``engine``: part -> bytes on one device of each (the engine's are on the
    trainer's device when colocated); ``peaks``: device -> peak bytes ("trainer", and "engine"
    when it has its own devices); ``capacity``: bytes of one device (None: unknown, no
    verdict); ``change``: the smallest change found that fits, when it does not."""

    model: str
    setup: Setup
    trainer: dict[str, int]
    engine: dict[str, int]
    peaks: dict[str, int]
    capacity: int | None
    change: str | None = None
    unsized: dict[str, str] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        """The largest peak over the devices."""
        return max(self.peaks.values())

    @property
    def fits(self) -> bool | None:
        """Whether every device's peak leaves ``MARGIN`` of its capacity free (None: no
        capacity known, or a part not sized and the sized ones fit)."""
        if self.capacity is None:
            return None
        if self.peak > (1 - MARGIN) * self.capacity:
            return False
        return None if self.unsized else True

    def table(self) -> str:
        """A markdown table of the parts, the peaks and the verdict."""
        lines = ["| part | per device |", "|---|---|"]
        for part in TRAIN_PARTS:
            size = "not sized" if part in self.unsized else _gib(self.trainer[part])
            lines.append(f"| {part} | {size} |")
        for part in ENGINE_PARTS:
            where = "" if self.setup.colocated else " (engine device)"
            size = "not sized" if part in self.unsized else _gib(self.engine[part])
            lines.append(f"| {part}{where} | {size} |")
        for device, peak in self.peaks.items():
            lines.append(f"| **peak, {device}** | **{_gib(peak)}** |")
        return "\n".join(lines)

    def verdict(self) -> str:
        """One line: fits or not, against what, and the change that fits when it does not."""
        reasons: dict[str, list[str]] = {}
        for part, why in self.unsized.items():
            reasons.setdefault(why, []).append(part)
        unsized = "".join(f"; could not size {', '.join(parts)}: {why}"
                          for why, parts in reasons.items())  # fmt: skip
        if self.unsized and self.fits is not False:
            return f"no verdict: the sized parts come to {_gib(self.peak)} per device{unsized}"
        if self.capacity is None:
            return f"peak {_gib(self.peak)} per device (device size unknown: no verdict){unsized}"
        room = (1 - MARGIN) * self.capacity
        if self.fits:
            return (
                f"fits: peak {_gib(self.peak)} of {_gib(self.capacity)} per device "
                f"({self.peak / self.capacity:.0%}){unsized}"
            )
        change = (
            f"; smallest change that fits: {self.change}"
            if self.change
            else ("; no single change or pair of the planner's fits")
        )
        return (
            f"does not fit: peak {_gib(self.peak)} against {_gib(room)} usable of "
            f"{_gib(self.capacity)} per device{change}{unsized}"
        )

    def __str__(self) -> str:
        return f"{self.headline()}\n{self.table()}\n{self.verdict()}"

    def _repr_markdown_(self) -> str:  # a notebook cell's output
        return f"{self.headline()}\n\n{self.table()}\n\n{self.verdict()}"

    def headline(self) -> str:
        """One line: the model and the setup planned."""
        s = self.setup
        layout = f"{s.world} rank(s), tp {s.tp}, sp {s.sp}"
        engine = ""
        if s.engine:
            engine = (
                f"; {s.engine} engine, {s.rollout_rows} rows of {s.rollout_tokens} tokens"
                f"{', colocated' if s.colocated else ''}{', sleeping' if s.sleep else ''}"
            )
        head = (
            f"memory plan of {self.model}: {str(s.dtype).removeprefix('torch.')}"
            f"{' with bf16 autocast' if s.autocast else ''}, "
            f"{'LoRA' if s.lora else 'full'}, {s.optimizer}, {s.tokens} tokens per forward"
            f"{', checkpointing' if s.gradient_checkpointing else ''}, {layout}{engine}"
        )
        return head


def plan(
    model: Any,
    *,
    dtype: str | torch.dtype = "bf16",
    optimizer: str = "adamw",
    lora: Any = None,
    reference: bool | None = None,
    gradient_checkpointing: bool = False,
    tokens: int = 4096,
    logprob_chunk_size: int | None = None,
    world: int = 1,
    tp: int = 1,
    sp: int = 1,
    engine: EngineMemory | SizedEngine | type[SizedEngine] | None = DEFAULT_ENGINE,
    rollout_rows: int = 64,
    rollout_tokens: int = 1024,
    engine_copy: bool | None = None,
    colocated: bool = True,
    sleep: bool = False,
    gpu_memory_utilization: float = 0.5,
    device_memory: int | None = None,
    shape: ModelShape | None = None,
    autocast: bool = False,
) -> Plan:
    """Size a run before it loads anything: bytes per device by part, the peak, and whether it
    fits ``device_memory`` (bytes of one device; None: the first CUDA device's total, else this
    machine's RAM), with the smallest change that fits when it does not (module docstring).

    ``model``: a transformers config, a model, a folder or a built-in name; ``lora``: a
    ``peft.LoraConfig`` (only the adapters train) or None; ``reference``: keep a frozen copy for
    KL (None: as ``PolicyTrainer`` does, a copy for a full model, none with LoRA); ``tokens``:
    tokens of one training forward (``micro_batch_tokens``, or rows × length padded);
    ``world``: trainer ranks, ``tp`` / ``sp`` their tensor / sequence parallel sizes;
    ``engine``: the engine class or instance (``rb.rollout.HFEngine``, ``VLLMEngine``,
    ``rb.rollout.ENGINES[name]``: the planner asks its ``memory_model()``), an
    ``rb.interfaces.EngineMemory``, or None (no engine), sampling ``rollout_rows`` rows of up to
    ``rollout_tokens`` tokens (prompt + response); ``engine_copy``: the engine holds its own
    weights (None: as its memory model says); ``colocated``: the engine shares the trainer's
    devices; ``sleep``: a colocated engine that can sleep (vLLM) frees its memory while the
    trainer runs;
    ``autocast``: bf16 autocast over ``dtype`` parameters (what ``PolicyTrainer`` runs on a GPU
    for a float32 model): weights, gradients and AdamW state in ``dtype``, activations in
    bf16."""
    from rlblocks.losses.entropy import DEFAULT_CHUNK_SIZE

    torch_dtype = _dtype(dtype)
    optimizer = optimizer.lower()
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"plan: optimizer={optimizer!r} is not sized; use one of {sorted(OPTIMIZER_STATES)}"
        )
    for name, value in (("tokens", tokens), ("world", world), ("tp", tp), ("sp", sp),
                        ("rollout_rows", rollout_rows), ("rollout_tokens", rollout_tokens)):  # fmt: skip
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"plan: {name}={value!r}; pass a positive int")
    if world % (tp * sp):
        raise ValueError(
            f"plan: world={world} ranks do not split into tp={tp} × sp={sp} groups; pass a world "
            f"that is a multiple of {tp * sp}"
        )
    # What PolicyTrainer refuses is refused here too, rather than planned.
    if lora is not None and world > 1:
        raise ValueError(
            f"plan: LoRA over world={world} ranks: PolicyTrainer does not shard a LoRA policy "
            "with FSDP yet; plan LoRA on one rank, or full fine-tuning over several"
        )
    if sp > 1 and (tp > 1 or gradient_checkpointing):
        raise ValueError(
            f"plan: sp={sp} with {'tp=' + str(tp) if tp > 1 else 'gradient checkpointing'} is "
            "not built (TrainConfig refuses it); use one of them"
        )
    if device_memory is not None and (
        isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory < 1
    ):
        raise ValueError(
            f"plan: device_memory={device_memory!r}; pass the bytes of one device as a positive "
            "int (None: this machine's device or RAM)"
        )
    memory = _memory_model(engine)
    if not 0 < gpu_memory_utilization <= 1:  # a NaN fails this too
        raise ValueError(
            f"plan: gpu_memory_utilization={gpu_memory_utilization}; pass a share in (0, 1]"
        )
    compute = torch.bfloat16 if autocast else torch_dtype
    if shape is None:
        shape = model_shape(model, lora=lora, dtypes=tuple({torch_dtype, compute}))
    setup = Setup(
        dtype=torch_dtype,
        optimizer=optimizer,
        lora=lora is not None,
        reference=(lora is None) if reference is None else reference,
        gradient_checkpointing=gradient_checkpointing,
        tokens=tokens,
        logprob_chunk_size=logprob_chunk_size or DEFAULT_CHUNK_SIZE,
        world=world,
        tp=tp,
        sp=sp,
        engine=memory,
        rollout_rows=rollout_rows,
        rollout_tokens=rollout_tokens,
        engine_copy=(memory is not None and memory.own_weights)
        if engine_copy is None
        else engine_copy,
        colocated=colocated,
        sleep=sleep and memory is not None and memory.sleeps and colocated,
        gpu_memory_utilization=gpu_memory_utilization,
        autocast=autocast,
    )
    capacity = device_memory if device_memory is not None else _device_memory()
    result = _size(shape, setup, capacity)
    if result.fits is False:
        result = dataclasses.replace(result, change=_smallest_change(model, lora, shape, setup,
                                                                     capacity))  # fmt: skip
    return result


def _size(shape: ModelShape, s: Setup, capacity: int | None) -> Plan:
    b = s.dtype.itemsize
    shards = s.world // s.tp  # FSDP shards (sp ranks shard too)
    split = s.tp * shards
    weights = shape.params * b // split
    if shards > 1:
        # FSDP2 gathers the root (embeddings, final norm, head: everything outside the decoder
        # layers) for the whole step, and two layers at a time.
        other = shape.params - shape.layers * shape.layer_params
        weights += (other + 2 * shape.layer_params) * b // s.tp
    tokens = math.ceil(s.tokens / s.sp)
    vocab = math.ceil(shape.vocab / s.tp)
    chunk = min(s.logprob_chunk_size, tokens)
    # The head's backward, chunk by chunk (rlblocks.losses.entropy._LinearTokenScores): five
    # float32 chunk × vocabulary buffers at once (logits, scaled, softmax, gradient and a
    # product), the gradient of the hidden states, and the head's float32 weight gradient when
    # the head trains (not with LoRA).
    head_grad = 0 if s.lora else vocab * shape.hidden * 4
    logits = 20 * chunk * vocab + tokens * shape.hidden * s.compute.itemsize + head_grad
    trainer = {
        "weights": weights,
        "reference": shape.params * b // split if s.reference else 0,
        "gradients": shape.trainable * b // split,
        "optimizer": OPTIMIZER_STATES[s.optimizer] * shape.trainable * b // split,
        "activations": _activations(shape, s, tokens, logits),
        "logits": logits,
    }
    engine = {"engine copy": 0, "kv cache": 0}
    if s.engine is not None and s.engine.kv_cache == "pool":
        if capacity is not None:
            engine["engine copy"] = shape.params * b
            pool = int(s.gpu_memory_utilization * capacity)
            engine["kv cache"] = max(pool - engine["engine copy"], 0)
    elif s.engine is not None:
        engine["engine copy"] = shape.params * b if s.engine_copy else 0
        kv = s.rollout_rows * s.rollout_tokens * shape.layers * shape.kv_width * b
        step_logits = 2 * s.rollout_rows * shape.vocab * 4  # the last position's scores, float32
        engine["kv cache"] = kv + step_logits
    engine_total = sum(engine.values())
    resident = trainer["weights"] + trainer["reference"] + trainer["optimizer"]
    train_phase = sum(trainer.values())
    if s.colocated:
        held = 0 if s.sleep else engine_total
        peaks = {"trainer": max(train_phase + held, resident + engine_total)}
    else:
        peaks = {"trainer": train_phase}
        if s.engine is not None:
            peaks["engine"] = engine_total
    unsized = dict(shape.unsized)
    if s.engine is not None and s.engine.kv_cache == "pool" and capacity is None:
        unsized["kv cache"] = f"{s.engine} takes a share of the device, whose size is unknown"
    return Plan(shape.name, s, trainer, engine, peaks, capacity, unsized=unsized)


def _memory_model(
    engine: EngineMemory | SizedEngine | type[SizedEngine] | None,
) -> EngineMemory | None:
    """What ``engine`` says of its memory: its ``memory_model()``, or the model itself. A name
    is refused: the planner imports no engine (the caller looks it up in ENGINES)."""
    if engine is None or isinstance(engine, EngineMemory):
        return engine
    if isinstance(engine, SizedEngine):
        return engine.memory_model()
    raise ValueError(
        f"plan: engine={engine!r}; pass an engine class or instance with a memory_model() "
        "(rb.rollout.HFEngine, rb.rollout.ENGINES['vllm']), an rb.interfaces.EngineMemory or "
        "None: the planner sizes engines by their memory model and imports none by name"
    )


def _activations(shape: ModelShape, s: Setup, tokens: int, head: int) -> int:
    """The activation bytes at the step's peak, beyond the head's working set ``head`` (the
    ``logits`` part). The layers keep every saved tensor, or with checkpointing only their
    inputs; outside them the final norm's input and output, the hidden states the head keeps
    and the rotary tables (4 × hidden × dtype bytes per token, read off the tiny model's and
    SmolLM2's traces). The peak comes in one of two places: the head's backward (all of that
    kept, and ``head``), or a layer's backward (all of that kept; with checkpointing the layer
    recomputed; and the gradients of the layer's largest tensor and of its two inputs, 3 ×
    the largest saved tensor; by then the head's and the final norm's tensors are freed).
    The larger of the two, less ``head``, is counted here."""
    if s.compute not in shape.act_per_token:
        return 0
    total, wide, largest = shape.act_per_token[s.compute]
    per_layer = wide + (total - wide) / s.tp  # per token
    b = s.compute.itemsize
    outside = 4 * shape.hidden * b
    layers: float  # bytes per token of every layer
    if s.gradient_checkpointing:
        layers = shape.layers * shape.hidden * b
        layer_phase = tokens * (layers + per_layer + 3 * largest / s.tp)
    else:
        layers = shape.layers * per_layer
        layer_phase = tokens * (layers + 3 * largest / s.tp)
    head_phase = tokens * (layers + outside) + head
    return int(max(head_phase, layer_phase) - head)


def _smallest_change(
    model: Any, lora: Any, shape: ModelShape, s: Setup, capacity: int | None
) -> str | None:
    """The first of the planner's changes (least disruptive first) that fits, else the first
    pair that does; None if none does."""
    changes: list[tuple[str, dict[str, Any]]] = []
    if not s.gradient_checkpointing and s.sp == 1:
        changes.append(("gradient_checkpointing=True", {"gradient_checkpointing": True}))
    tokens = s.tokens
    while tokens > 256:
        tokens //= 2
        changes.append((f"tokens={tokens} per forward", {"tokens": tokens}))
    if s.engine is not None and s.engine.sleeps and s.colocated and not s.sleep:
        changes.append((f"{s.engine} sleep mode while training", {"sleep": True}))
    if s.engine is not None and s.engine.kv_cache == "rows" and s.rollout_rows > 8:
        changes.append((f"rollout_rows={s.rollout_rows // 2}",
                        {"rollout_rows": s.rollout_rows // 2}))  # fmt: skip
    if s.dtype == torch.float32:
        changes.append(("dtype=bf16", {"dtype": torch.bfloat16}))
    if s.reference and not s.lora:
        changes.append(("no reference model (beta=0)", {"reference": False}))
    for world in (2, 4, 8) if not s.lora else ():  # LoRA is not sharded (above)
        if world > s.world:
            changes.append((f"world={world} ranks (FSDP shards)", {"world": world}))
    traced: dict[torch.dtype, ModelShape] = {s.compute: shape}

    def fits(setup: Setup) -> bool:
        if setup.compute not in traced:  # a change of dtype: trace the layer in it too
            extra = model_shape(model, lora=lora, dtypes=(setup.compute,))
            traced[setup.compute] = dataclasses.replace(
                shape, act_per_token={**shape.act_per_token, **extra.act_per_token}
            )
        return bool(_size(traced[setup.compute], setup, capacity).fits)

    for name, override in changes:
        if fits(dataclasses.replace(s, **override)):
            return name
    for i, (first, a) in enumerate(changes):
        for second, b in changes[i + 1 :]:
            if not set(a) & set(b) and fits(dataclasses.replace(s, **a, **b)):
                return f"{first} and {second}"
    return None


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"plan: dtype={dtype!r}; use one of {sorted(DTYPES)} or a torch.dtype")
    return DTYPES[dtype]


def _device_memory() -> int | None:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 1024**2:.1f} MiB"
