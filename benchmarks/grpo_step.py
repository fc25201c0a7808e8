"""What does one GRPO step cost in rlblocks, next to plain PyTorch and to TRL?

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 nice -n 19 python benchmarks/grpo_step.py [--beta 0.04]
    python benchmarks/grpo_step.py --responses eos            # EOS-terminated, mixed lengths
    python benchmarks/grpo_step.py --model qwen2-0.5b-random --dtype bf16 --device cuda \\
        --responses eos --out runs/gpu                           # the GPU check (docs/gpu.md)

One step: ``--group-size`` responses to each of ``--prompts`` chat prompts, the math-answer
reward, rewards standardized within each group, one clipped-surrogate update (ε = (0.2, 0.28),
token-mean loss, gradient norm clipped to 1, AdamW) of every weight. Every system does it on the
same model (default the built-in ``"smollm2-135m"``; ``--dtype``, ``--device``), the same prompts
at each step index and the same sampling settings:

- **floor**: transformers and torch only, written here: the chat template, ``model.generate``
  (T = 1, no top-k / top-p), the reward, forwards with ``logits_to_keep`` over the response
  tokens and their backward (``--micro-batch`` rows at a time, each a slice of the padded
  ``(b s)`` batch), ``clip_grad_norm_``, ``torch.optim.AdamW``. On-policy with one update the
  ratio is 1, so π_old is the detached current log-prob: no extra forward.
- **rlblocks**: what a user writes: ``PolicyTrainer.from_pretrained(model, lr=...,
  reference=None)`` with TrainConfig's defaults (padding-free packing where TrainConfig has
  ``packing``), a ``CompiledEngine`` sharing its model, ``rb.recipes.grpo(...,
  loss_fn=partial(rb.losses.clipped_surrogate, clip=(0.2, 0.28)))``: the engine samples with
  the trainer's own module, so its log-probs are π_old and nothing is scored before the update
  (``rlblocks-recompute`` scores π_old anyway, one forward more). Its engine is the fastest
  rlblocks has, ``rb.rollout.CompiledEngine`` (its decode step compiled whole, CUDA graphs on
  a GPU; the same step eagerly on a CPU, where that measured faster: ``benchmarks/rollout.py``);
  **rlblocks-hf** is the same with an ``HFEngine`` (``model.generate``).
- **rlblocks-padded**: the same with ``packing=False`` (right-padded rows, as before issue 27);
  skipped where TrainConfig has no ``packing``.
- **rlblocks-cb**: the same with ``rb.rollout.ContinuousBatchingEngine`` (transformers'
  continuous batching) in place of the ``CompiledEngine``; skipped where rlblocks has none.
- **rlblocks-async**: the same recipe one step off (``run=rb.run.RunOptions(staleness=1,
  old_logprobs="rollout")``): the engine, on its own copy of the weights, samples the next
  batch in a thread while the trainer updates; π_old is the engine's log-probs
  (``rlblocks-async-recompute`` scores it with the trainer). With ``--threads 1`` the two
  sides run on two cores where the others run on one. Its run takes one more step at the end,
  left out like the warm-up (a run's last step has no next batch to overlap with).
- **trl**: ``trl.GRPOTrainer`` (skipped without trl) on a model object from the same file, its
  tokenizer as ``processing_class``, a ``datasets.Dataset`` whose "prompt" column holds the
  same chat messages in step order (``shuffle_dataset=False``); ``generation_batch_size =
  prompts × group size``, ``num_generations = group size``, ``per_device_train_batch_size =
  --micro-batch`` and as many gradient-accumulation steps as make the batch: one generation and
  one optimizer step a step. TRL's defaults otherwise (``loss_type="dapo"``,
  ``optim="adamw_torch_fused"``), with ``epsilon_high=0.28``, a constant learning rate, no
  gradient checkpointing (TRL's default turns it on; no other system recomputes its forward),
  ``bf16`` when ``--dtype bf16``, ``use_cpu`` on a CPU, no logging, saving or evaluation.

``--beta`` > 0 adds the KL loss β·k3 everywhere: ``rb.losses.kl_regularized`` with
``reference="copy"``, TRL's ``beta`` (its reference loaded from the same folder), a frozen copy
scored without grad in the floor.

**Responses.** ``--responses fixed`` (the default): every response is exactly
``--max-new-tokens`` long, because EOS is held back until then (``min_new_tokens`` in every
system; Hugging Face's ``MinNewTokensLengthLogitsProcessor`` sets the EOS logit to −inf), and
the run stops if a system's responses are not all that long. ``--responses eos``: responses end
at EOS, so their lengths are mixed and the padded systems compute padding. A trained model stops
where it stops; the random models (``tiny``, ``qwen2-0.5b-random``) would almost never sample
EOS (1 in the vocabulary size), so in this mode they are written with an *EOS hazard*
(:func:`plant_eos_hazard`): a weight pattern that gives EOS probability ``--eos-hazard`` at
every position (default 4 / ``--max-new-tokens``, capped at 0.5: a geometric length of mean
about a quarter of the budget, a few rows reaching it), the same model for every system.

**Measured per system** (median over the timed steps): seconds per step and per phase,

    rollout    generation (rlblocks time/rollout; TRL's "transformers.generate" block)
    reward     the reward (the floor: and the advantages)
    logprobs   no-grad scoring before the update: π_old and π_ref in rlblocks (time/logprobs,
               which the recipe loop takes out of time/update), π_ref in the floor and TRL
    update     forward, backward, clipping, optimizer step (rlblocks time/update; TRL: from
               the end of its generating _prepare_inputs to the end of the optimizer step)
    sync       weights into the engine (rlblocks time/sync; the model is shared: ~0)
    other      the rest of the step (advantages in rlblocks, batching in TRL)

and, from a forward pre-hook on the model's decoder stack (:class:`ForwardCounter`: every
forward given no KV cache, that is every scoring and training forward, none of generation's):

- ``pad``: padding share, 1 − real tokens / tokens computed, over the step's scoring and
  training forwards. A padded forward of ``(b s)`` computes b·s tokens (the floor: the whole
  padded batch, every forward); a packed one only its real tokens.
- ``gen tok/s``: response tokens / rollout seconds.
- ``MFU``: the update's model FLOPs per second over the FLOP/s of a ``--matmul-size`` square
  matmul in the run's dtype on the run's device, measured in the same run (:func:`matmul_flops`).
  Update FLOPs (:func:`update_flops`) = 6·N_body·T + 6·N_head·T_resp + 6·L·H·d_h·Σᵢ nᵢ²: T the
  real tokens of the training forwards and nᵢ their rows' lengths, T_resp the response tokens
  (the LM head scores only those), N_body the weights of every ``nn.Linear`` of the decoder
  stack, N_head the LM head's; 6 = forward (2) + backward (4) FLOPs per weight and token; the
  last term is causal attention (QKᵀ and AV, half of each square, forward and backward) with L
  layers of H query heads of width d_h. Padding is not counted: it is no model work.
- ``peak``: peak memory of the system's run, model loading included:
  ``torch.cuda.max_memory_allocated`` on a GPU (reset before each system), the process's peak
  resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) on a CPU.

**Protocol.** ``--repeats`` rounds; in round r each system runs ``--steps`` steps on a model
loaded fresh, seeded with ``--seed``, in an order rotated by r, so that a busy spell of the
shared machine does not always hit the same system. The first step of a run is a warm-up, left
out. The spread is the lowest and highest median of a round. On a GPU each phase boundary of
the floor and the end of every rlblocks update wait for the device (``torch.cuda.synchronize``).
``--keep-going`` records a system that fails (its error in the results, its traceback printed)
and runs the others, exiting with status 1 at the end. ``--out DIR`` writes ``results.json`` (every step of every system, the setup, the matmul, the
model's sizes, skipped systems and why) and ``results.md`` (the table), rewritten after each
system so a run cut short keeps what it measured.

TRL times its phases in ``profiling_context`` blocks that report only to wandb / mlflow /
trackio: ``ProfilingContext._log_metrics`` is wrapped here to record them. A TRL step is timed
by a ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end``.

**Adding a system** is a function ``(Setup) -> list[StepTime]`` (raising :class:`Skipped`
when it cannot run here) and an entry in ``SYSTEMS``; a variant of the recipe is a ``partial``
of ``run_rlblocks``. ``torch.set_num_threads(--threads)`` is called before every run and the
count seen during the steps printed. ``--model tiny`` runs it all in seconds (the test suite
does).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from transformers import GenerationConfig, Qwen2ForCausalLM

import rlblocks as rb
from rlblocks.data import PromptBatch, PromptBatches, arithmetic_prompts
from rlblocks.rewards.math import math_answer_score
from rlblocks.trainer.allocator import keep_freed_memory

CLIP = (0.2, 0.28)  # DAPO clip-higher: ratio kept in [1 − 0.2, 1 + 0.28]
PHASES = ("rollout", "reward", "logprobs", "update", "sync")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Qwen2.5-0.5B's config.json, written out (nothing is downloaded): 494M parameters, 136M of
# them the tied 151936 x 896 embedding that is also the LM head.
QWEN25_05B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}
# SmolLM2-135M's shape (the built-in model, a Llama) as a Qwen2: 30 layers of hidden 576, 9
# query and 3 key-value heads, MLP 1536, the tied 49152-token vocabulary. The same matrices but
# for Qwen2's q/k/v biases (0.06M of 135M parameters): its CPU cost with random weights, so
# that EOS can be planted (--responses eos) for mixed lengths at the main job's shapes.
SMOLLM2_135M: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}
RANDOM_MODELS = {
    "qwen2-0.5b-random": QWEN25_05B,
    "smollm2-135m-random": SMOLLM2_135M,
    "tiny": {},
}
"""Models built here from random weights with rb.models' tokenizer (a 384-token byte-level BPE;
the model's vocabulary is not cut to it: ids the tokenizer lacks decode to nothing)."""


class Skipped(Exception):
    """A system that cannot run here (a package or a class it needs is missing): the reason."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every system is given: the same model file, prompts, shapes and device."""

    model: str
    batches: tuple[PromptBatch, ...]
    """One batch of prompts per step, the same for every system."""
    group_size: int
    max_new_tokens: int
    lr: float
    beta: float
    seed: int
    responses: str = "fixed"
    """"fixed": every response max_new_tokens long; "eos": responses end at EOS."""
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    micro_batch: int | None = None
    """Rows per forward/backward of the update (None: the whole batch)."""

    @property
    def rows(self) -> int:
        return len(self.batches[0]) * self.group_size

    @property
    def min_new_tokens(self) -> int:
        return self.max_new_tokens if self.responses == "fixed" else 0


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One step of one system."""

    seconds: float
    phases: dict[str, float]
    """Seconds per phase of ``PHASES``; the rest of ``seconds`` is "other"."""
    tokens: int
    """Prompt + response tokens of the step."""
    response_tokens: int
    threads: int
    computed: int = 0
    """Tokens the scoring and training forwards computed (b·s of each padded forward)."""
    real: int = 0
    """Real (non-padding) tokens in those forwards."""
    trained: int = 0
    """Real tokens of the training (grad) forwards: T of the update's FLOPs."""
    trained_sq: int = 0
    """Σ nᵢ² over the rows of the training forwards (attention FLOPs)."""

    @property
    def padding(self) -> float:
        return 1 - self.real / self.computed if self.computed else 0.0


System = Callable[[Setup], "list[StepTime]"]


# ---------------------------------------------------------------------- measuring
@dataclasses.dataclass(frozen=True)
class Counts:
    computed: int
    real: int
    trained: int
    trained_sq: int


class ForwardCounter:
    """Tokens computed and real in a model's scoring and training forwards.

    A forward pre-hook on the decoder stack (``model.get_decoder()``), which every forward
    reaches whether it goes through ``model(...)`` or calls the stack and the LM head apart.
    Forwards given a KV cache (``past_key_values``, or continuous batching's ``cache``) are
    generation and not counted. Per forward: computed = b·s; the rows' real lengths from
    ``cu_seq_lens_q`` (varlen packing), else for a single row with ``position_ids`` the runs
    that restart at position 0 (packed rows), else the attention mask's row sums, else s.
    Deep copies of the model (an engine's own weights) carry the hook; their forwards are
    generation, so nothing is counted twice.
    """

    def __init__(self, model: nn.Module) -> None:
        stack = model.get_decoder() if hasattr(model, "get_decoder") else model
        self._handle = stack.register_forward_pre_hook(self._count, with_kwargs=True)
        self._totals: list[Tensor | int] = [0, 0, 0, 0]

    def _count(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"][..., 0]
        b, s = ids.shape[:2]
        lengths = row_lengths(kwargs, b, s, ids.device)
        self._totals[0] += b * s
        self._totals[1] = self._totals[1] + lengths.sum()
        if torch.is_grad_enabled():
            self._totals[2] = self._totals[2] + lengths.sum()
            self._totals[3] = self._totals[3] + (lengths * lengths).sum()

    def take(self) -> Counts:
        """The counts since the last take (one device sync), reset to zero."""
        values = [int(v) for v in self._totals]
        self._totals = [0, 0, 0, 0]
        return Counts(*values)

    def close(self) -> None:
        self._handle.remove()


def row_lengths(kwargs: dict, b: int, s: int, device: torch.device) -> Tensor:
    """Real tokens of each sequence in one forward's inputs (see :class:`ForwardCounter`)."""
    cu = kwargs.get("cu_seq_lens_q")
    if isinstance(cu, Tensor):
        return cu.diff().long()
    mask = kwargs.get("attention_mask")
    mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
    positions = kwargs.get("position_ids")
    if b == 1 and isinstance(positions, Tensor):
        real = torch.ones(s, dtype=torch.bool) if mask is None else mask[0].bool().cpu()
        starts = ((positions[0].cpu() == 0) & real).nonzero()[:, 0]
        ends = torch.cat([starts[1:], real.nonzero()[-1:, 0] + 1])
        return (ends - starts).long()
    if mask is not None:
        return mask.long().sum(-1)
    return torch.full((b,), s, dtype=torch.long, device=device)


def with_counts(step: StepTime, counts: Counts) -> StepTime:
    return dataclasses.replace(step, **dataclasses.asdict(counts))


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on a CPU): wall clocks then time the work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def peak_memory(device: str) -> Iterator[list[int]]:
    """The peak bytes of the ``with`` block, appended to the yielded list at its end:
    ``torch.cuda.max_memory_allocated`` on a GPU; on a CPU the process's peak resident set,
    reset at entry through ``/proc/self/clear_refs`` (0 where Linux offers neither)."""
    found: list[int] = []
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    try:
        yield found
    finally:
        found.append(torch.cuda.max_memory_allocated() if cuda else peak_rss())


def peak_rss() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def matmul_flops(device: str, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """FLOP/s of an n×n×n matmul in ``dtype`` on ``device`` (:func:`gemm_flops`)."""
    return gemm_flops(device, dtype, n, n, n, repeats=repeats, warmups=3)


def gemm_flops(device: str, dtype: torch.dtype, m: int, k: int, n: int, *, repeats: int = 10,
               warmups: int = 3) -> float:  # fmt: skip
    """FLOP/s of an (m×k)·(k×n) product in ``dtype`` on ``device``: 2mkn per product, the mean
    of ``repeats`` products after ``warmups``, on normal random data."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=dtype, generator=generator)
    b = torch.randn(k, n, device=device, dtype=dtype, generator=generator)
    for _ in range(warmups):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * m * k * n * repeats / (time.perf_counter() - start)


def print_profile(heading: str, run: Callable[[], Any], top: int) -> None:
    """The ``top`` aten operators of one ``run()`` by self time (the profiler's own overhead
    included), with their share of its wall time, under ``heading`` (``{wall}``: the seconds
    the run took under the profiler)."""
    start = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(heading.format(wall=wall))
    for e in events[:top]:
        seconds = e.self_cpu_time_total / 1e6
        print(f"  {e.key[:60]:<60} {e.count:>7} calls {seconds:>8.2f} s {seconds / wall:>6.1%}")


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """What the FLOP count needs of a model: its matmul weights and its attention shape."""

    body: int
    """Weights of every nn.Linear of the decoder stack."""
    head: int
    """Weights of the LM head (tied to the embedding or not: it multiplies either way)."""
    layers: int
    heads: int
    head_dim: int
    parameters: int
    """Distinct parameters (tied ones once)."""


def model_size(path: str) -> ModelSize:
    """:class:`ModelSize` of the model at ``path`` (a built-in name or folder), built on the
    meta device: no weights are read or allocated."""
    config = transformers.AutoConfig.from_pretrained(rb.models.resolve(path))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules()
               if isinstance(m, nn.Linear) and m is not head)  # fmt: skip
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelSize(body, head.weight.numel(), config.num_hidden_layers, heads, head_dim,
                     sum(p.numel() for p in model.parameters()))  # fmt: skip


def update_flops(size: ModelSize, step: StepTime) -> float:
    """Model FLOPs of one update: 6·N_body·T + 6·N_head·T_resp + 6·L·H·d_h·Σ nᵢ² (module
    docstring): forward and backward of every matmul over the real tokens, the LM head over the
    response tokens only, and causal attention."""
    attention = 6 * size.layers * size.heads * size.head_dim * step.trained_sq
    return 6 * size.body * step.trained + 6 * size.head * step.response_tokens + attention


# ---------------------------------------------------------------------- models
def build_random_model(
    name: str, folder: Path, *, seed: int, dtype: torch.dtype, device: str, hazard: float | None
) -> str:
    """Write the random model ``name`` (``RANDOM_MODELS``) with rb.models' tokenizer into
    ``folder``, with an EOS hazard when ``hazard`` is given; returns the folder."""
    tokenizer = rb.models.tiny_tokenizer()
    config = rb.models.tiny_config(tokenizer, **RANDOM_MODELS[name])
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    if hazard is not None:
        plant_eos_hazard(model, tokenizer.eos_token_id, hazard)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def plant_eos_hazard(model: Qwen2ForCausalLM, eos: int, hazard: float, channel: int = 0) -> None:
    """Make a random Qwen2 sample EOS with probability ``hazard`` at every position.

    One hidden channel c carries a constant: every token's embedding holds K = √d there, and no
    layer reads it (its input columns of q/k/v/gate/up are 0) or writes it (its output rows of
    o/down are 0), so the residual stream holds K at c to the end, where it dominates the final
    RMS norm (the rest of the stream keeps the random init's scale, ~0.02 a channel). The final
    norm's weight at c is 1/K, so the normed value there is ≈ 1. The LM head is the tied
    embedding: every token's logit gets 1·K (a common shift, no effect on the softmax) and EOS,
    whose embedding holds K + Δ at c, gets Δ more, with Δ = log(hazard·(V − 1)/(1 − hazard)):
    the other logits are ≈ equal (the random init's ≈ 0.02 · 0.02 · √d), so P(EOS) ≈ hazard.
    """
    config = model.config
    if not config.tie_word_embeddings:
        raise ValueError(
            f"plant_eos_hazard: the model's LM head is not tied to its embedding "
            f"(tie_word_embeddings={config.tie_word_embeddings}); build it with tied embeddings"
        )
    k = config.hidden_size**0.5
    delta = math.log(hazard * (config.vocab_size - 1) / (1 - hazard))
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, channel] = k
        embedding[eos, channel] = k + delta
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for reader in (attention.q_proj, attention.k_proj, attention.v_proj,
                           mlp.gate_proj, mlp.up_proj):  # fmt: skip
                reader.weight[:, channel] = 0
            for writer in (attention.o_proj, mlp.down_proj):
                writer.weight[channel] = 0
        model.model.norm.weight[channel] = 1 / k


def prepare_model(args: argparse.Namespace, folder: Path) -> str:
    """The model every system loads: ``--model`` itself, or a random model written into
    ``folder`` (``qwen2-0.5b-random`` and ``smollm2-135m-random`` always; ``tiny`` only for
    EOS-terminated responses, which
    it needs the hazard for)."""
    random_model = args.model in ("qwen2-0.5b-random", "smollm2-135m-random") or (
        args.model == "tiny" and args.responses == "eos"
    )
    if not random_model:
        return args.model
    hazard = eos_hazard(args) if args.responses == "eos" else None
    return build_random_model(args.model, folder, seed=args.seed, dtype=DTYPES[args.dtype],
                              device=args.device, hazard=hazard)  # fmt: skip


def eos_hazard(args: argparse.Namespace) -> float:
    return args.eos_hazard or min(0.5, 4 / args.max_new_tokens)


# ---------------------------------------------------------------------- floor
def response_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, t: int
) -> torch.Tensor:
    """log π(y_k) of the last ``t`` tokens of each row, (b t) float32: one forward, only the
    t positions that predict them go through the LM head."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding, as generate counts them
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=t + 1,
                use_cache=False)  # fmt: skip
    logits = out.logits[:, :-1].float()  # position j predicts token j + 1
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -t:, None])[..., 0]


def floor_generate(
    model: torch.nn.Module, tokenizer, prompts: list, group_size: int, config: GenerationConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + response ids (b s) and the prompt's attention mask (b tp), group_size rows a
    prompt: the chat template, left padding (rb.models.load sets it), ``model.generate``."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
             for p in prompts]  # fmt: skip
    enc = tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
    device = model.device
    prompt_ids = enc.input_ids.repeat_interleave(group_size, 0).to(device)
    prompt_mask = enc.attention_mask.repeat_interleave(group_size, 0).to(device)
    with torch.no_grad():
        ids = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask,
                             generation_config=config)  # fmt: skip
    return ids, prompt_mask


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r − mean of its group) / (std of its group + 1e-6), (b 1): GRPO's outcome advantage."""
    groups = rewards.view(-1, group_size)
    mean, std = groups.mean(-1, keepdim=True), groups.std(-1, keepdim=True)
    return ((groups - mean) / (std + 1e-6)).view(-1, 1)


def floor_update(
    model: nn.Module,
    reference: nn.Module | None,
    batch: tuple[Tensor, Tensor, Tensor, Tensor],
    setup: Setup,
    clock: Callable[[], None],
) -> None:
    """π_ref (if any) then forward and backward in slices of ``setup.micro_batch`` rows of the
    padded batch, the token-mean loss over the whole batch; ``clock()`` between the two."""
    ids, mask, response_mask, advantages = batch
    t, total = response_mask.shape[1], response_mask.sum()
    slices = [slice(i, i + (setup.micro_batch or len(ids))) for i in range(0, len(ids),
              setup.micro_batch or len(ids))]  # fmt: skip
    ref_logprobs = []
    if reference is not None:
        with torch.no_grad():
            ref_logprobs = [response_logprobs(reference, ids[s], mask[s], t) for s in slices]
    clock()  # logprobs
    model.train()
    for i, s in enumerate(slices):
        logprobs = response_logprobs(model, ids[s], mask[s], t)
        ratio = torch.exp(logprobs - logprobs.detach())  # 1, with the gradient of π_θ
        clipped = ratio.clamp(1 - CLIP[0], 1 + CLIP[1])
        per_token = -torch.min(ratio * advantages[s], clipped * advantages[s])
        if reference is not None:
            log_r = ref_logprobs[i] - logprobs
            per_token = per_token + setup.beta * (torch.exp(log_r) - log_r - 1)  # k3
        ((per_token * response_mask[s]).sum() / total).backward()  # token mean of the batch
    model.eval()


def mark(marks: list[float], device: str) -> None:
    """Append the time once the device's queued work is done: a phase boundary."""
    sync(device)
    marks.append(time.perf_counter())


def run_floor(setup: Setup) -> list[StepTime]:
    model, tokenizer = rb.models.load(setup.model, dtype=setup.dtype, device=setup.device)
    reference = copy.deepcopy(model).requires_grad_(False) if setup.beta else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
    eos, n, g = tokenizer.eos_token_id, setup.max_new_tokens, setup.group_size
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
        min_new_tokens=setup.min_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
    )  # fmt: skip
    counter = ForwardCounter(model)
    steps = []
    for batch in setup.batches:
        marks = [time.perf_counter()]
        clock = partial(mark, marks, setup.device)
        ids, prompt_mask = floor_generate(model, tokenizer, batch.prompts, g, config)
        response = ids[:, prompt_mask.shape[1] :]
        clock()  # rollout
        truths = [row.ground_truth for row in batch.rows for _ in range(g)]
        texts = tokenizer.batch_decode(response, skip_special_tokens=True)
        rewards = torch.tensor([math_answer_score(c, y) for c, y in zip(texts, truths)])
        advantages = group_advantages(rewards, g).to(ids.device)
        is_eos = (response == eos).long()
        response_mask = is_eos.cumsum(-1) - is_eos == 0  # up to and including the first EOS
        mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
        clock()  # reward
        floor_update(model, reference, (ids, mask, response_mask, advantages), setup, clock)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock()  # update
        phases = dict(zip(PHASES, [b - a for a, b in itertools.pairwise(marks)] + [0.0]))
        tokens, threads = int(mask.sum()), torch.get_num_threads()
        step = StepTime(marks[-1] - marks[0], phases, tokens, int(response_mask.sum()), threads)
        steps.append(with_counts(step, counter.take()))
    return steps


# ---------------------------------------------------------------------- rlblocks
def run_rlblocks(
    setup: Setup, *, engine: str = "fastest", train: dict[str, Any] | None = None, **run_options
) -> list[StepTime]:
    """``rb.recipes.grpo`` as a user calls it. ``engine``: "fastest" (``CompiledEngine``),
    "hf" (``HFEngine``) or "cb" (``ContinuousBatchingEngine``); ``train``: TrainConfig
    overrides (``packing``);
    ``run_options`` (`rlblocks.run.RunOptions` keywords: ``staleness``, ``old_logprobs``) make
    variants of it.

    ``staleness=1``: one-step-off rollouts; the engine then samples with its own copy of the
    weights (synced after every update), and the run takes one more step at the end, left out
    like the warm-up: a run's last step has no next batch to sample during its update."""
    train = train or {}
    fields = {f.name for f in dataclasses.fields(rb.trainer.TrainConfig)}
    missing = sorted(set(train) - fields)
    if missing:
        raise Skipped(f"TrainConfig has no {', '.join(missing)} in this rlblocks")
    engine_class = engine_class_for(engine)
    check_engine(engine, setup)
    overlap = run_options.get("staleness", 0) > 0
    policy = rb.trainer.PolicyTrainer.from_pretrained(
        setup.model, lr=setup.lr, reference="copy" if setup.beta else None, dtype=setup.dtype,
        device=setup.device, micro_batch_size=setup.micro_batch, **train,
    )  # fmt: skip
    model = copy.deepcopy(policy.model) if overlap else policy.model
    rollout_engine = engine_class(model, policy.tokenizer, chat=True, progress=False)
    counter = ForwardCounter(policy.model)
    policy.step = synced(policy.step, setup.device)  # the update's queued kernels count in it
    batches = list(setup.batches) + ([setup.batches[0]] if overlap else [])
    loss = partial(rb.losses.clipped_surrogate, clip=CLIP)
    if setup.beta:
        loss = rb.losses.kl_regularized(loss, kl_coef=setup.beta)  # k3, as TRL
    sampling = rb.SamplingParams(max_new_tokens=setup.max_new_tokens,
                                 min_new_tokens=setup.min_new_tokens, temperature=1.0)  # fmt: skip
    counts: list[tuple[int, int, int, Counts]] = []  # tokens, response tokens, threads, forwards

    def on_step(index: int, metrics: dict, ro: rb.Rollouts) -> None:  # outside the step's clock
        counts.append((int(ro.attention_mask.sum()), int(ro.response_mask.sum()),
                       torch.get_num_threads(), counter.take()))  # fmt: skip

    history = rb.recipes.grpo(
        policy,
        rollout_engine,
        rb.rewards.math_answer,
        batches,
        steps=len(batches),
        group_size=setup.group_size,
        sampling=sampling,
        loss_fn=loss,
        run=rb.run.RunOptions(on_step=on_step, progress=False, **run_options),
    )
    steps = [
        with_counts(StepTime(m["step_seconds"], {p: m[f"time/{p}"] for p in PHASES}, *c[:3]), c[3])
        for m, c in zip(history, counts, strict=True)
    ]
    return steps[: len(setup.batches)]


def engine_class_for(engine: str) -> type:
    """The rollout engine class of a system: "fastest" (``CompiledEngine``: compiled on CUDA,
    its eager step elsewhere, benchmarks/rollout.py measures both against the others), "hf"
    or "cb"; skipped where rlblocks has none."""
    if engine == "hf":
        return rb.rollout.HFEngine
    name = "CompiledEngine" if engine == "fastest" else "ContinuousBatchingEngine"
    found = getattr(rb.rollout, name, None)
    if found is None:
        raise Skipped(f"rb.rollout has no {name} in this rlblocks")
    return found


def check_engine(engine: str, setup: Setup) -> None:
    """Skip what an engine cannot sample: continuous batching cannot hold EOS back."""
    if engine == "cb" and setup.min_new_tokens:
        raise Skipped(
            "continuous batching cannot hold EOS back (min_new_tokens), which --responses fixed "
            "needs; pass --responses eos"
        )


def synced(step: Callable[..., dict], device: str) -> Callable[..., dict]:
    """``step`` followed by a device sync, so that the recipe's update clock holds its work."""

    def call(*args: Any, **kwargs: Any) -> dict:
        out = step(*args, **kwargs)
        sync(device)
        return out

    return call


# ---------------------------------------------------------------------- TRL
@contextlib.contextmanager
def trl_profiling() -> Iterator[list[tuple[str, float, float]]]:
    """``(name, start, seconds)`` of every TRL ``profiling_context`` block while inside (none
    with a TRL that has no ``ProfilingContext``: then only the update phase is filled in)."""
    records: list[tuple[str, float, float]] = []
    try:
        from trl.extras.profiling import ProfilingContext
    except ImportError:
        yield records
        return
    original = ProfilingContext._log_metrics

    def record(self: ProfilingContext, duration: float) -> None:
        records.append((self.name.split(".", 1)[-1], self._start_time, duration))
        original(self, duration)

    ProfilingContext._log_metrics = record
    try:
        yield records
    finally:
        ProfilingContext._log_metrics = original


def trl_steps(
    bounds: list[tuple[float, float, int, float, int, Counts]],
    records: list[tuple[str, float, float]],
    rows: int,
) -> list[StepTime]:
    """Each optimizer step's seconds, split into phases by the profiling blocks inside it:
    generation, reward, scoring inside the first ``_prepare_inputs`` (the one that generates;
    π_ref), and the update from its end (every micro-batch's forward, loss and backward,
    clipping, optimizer step)."""
    steps, seen = [], 0
    for begin, end, tokens_seen, length, threads, counts in bounds:
        inside = [(name, s, d) for name, s, d in records if begin <= s <= end]

        def seconds(block: str, before: float = end, inside=inside) -> float:
            return sum(d for name, s, d in inside if name == block and s < before)

        prepared = min((s + d for name, s, d in inside if name == "_prepare_inputs"), default=begin)
        phases = {
            "rollout": seconds("transformers.generate"),
            "reward": seconds("_calculate_rewards"),
            "logprobs": seconds("_get_per_token_logps_and_entropies", before=prepared),
            "update": end - prepared,
            "sync": 0.0,
        }
        step = StepTime(end - begin, phases, tokens_seen - seen, round(length * rows), threads)
        steps.append(with_counts(step, counts))
        seen = tokens_seen
    return steps


def run_trl(setup: Setup) -> list[StepTime]:
    try:
        import datasets
        import trl
    except ImportError as error:
        raise Skipped(f"{error}; pip install 'rlblocks[bench]'") from None

    class StepClock(transformers.TrainerCallback):
        """(begin, end, tokens seen so far, mean completion length, torch threads, forward
        counts) of every optimizer step; ``trainer`` is set once built."""

        def __init__(self, counter: ForwardCounter) -> None:
            self.bounds: list[tuple[float, float, int, float, int, Counts]] = []
            self.counter = counter

        def on_step_begin(self, args, state, control, **kwargs):
            sync(setup.device)
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(setup.device)
            end = time.perf_counter()
            length = self.trainer._metrics["train"]["completions/mean_length"][-1]
            seen, threads = state.num_input_tokens_seen, torch.get_num_threads()
            self.bounds.append((self.begin, end, seen, length, threads, self.counter.take()))

    def math_answer(completions: list, ground_truth: list[str], **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [math_answer_score(text, truth) for text, truth in zip(texts, ground_truth)]

    model, tokenizer = rb.models.load(setup.model, dtype=setup.dtype, device=setup.device)
    rows = [
        {"prompt": r.prompt, "ground_truth": r.ground_truth}
        for batch in setup.batches
        for r in batch.rows
    ]
    n, micro = setup.max_new_tokens, setup.micro_batch or setup.rows
    if setup.rows % micro:
        raise ValueError(
            f"run_trl: --micro-batch {micro} does not divide the {setup.rows} rows of a step; "
            "pass a divisor (TRL accumulates whole micro-batches)"
        )
    generation = {"min_new_tokens": n} if setup.responses == "fixed" else {}
    clock = StepClock(ForwardCounter(model))
    with tempfile.TemporaryDirectory() as folder, trl_profiling() as records:
        config = trl.GRPOConfig(
            output_dir=folder, max_steps=len(setup.batches), seed=setup.seed,
            # one step = one generation of prompts x group size rows = one optimizer step
            per_device_train_batch_size=micro, gradient_accumulation_steps=setup.rows // micro,
            generation_batch_size=setup.rows, num_generations=setup.group_size,
            shuffle_dataset=False,  # the dataset is in step order
            max_completion_length=n, generation_kwargs=generation,
            temperature=1.0, top_p=1.0, top_k=0,
            beta=setup.beta, epsilon=CLIP[0], epsilon_high=CLIP[1],
            learning_rate=setup.lr, lr_scheduler_type="constant",
            gradient_checkpointing=False,  # TRL's default is True; no other system recomputes
            use_cpu=torch.device(setup.device).type == "cpu",
            bf16=setup.dtype == torch.bfloat16, fp16=setup.dtype == torch.float16,
            disable_tqdm=True, report_to="none",
            logging_strategy="no", save_strategy="no", eval_strategy="no",
        )  # fmt: skip
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=math_answer,
            args=config,
            processing_class=tokenizer,
            train_dataset=datasets.Dataset.from_list(rows),
            callbacks=[clock],
        )
        held_back = trainer.generation_config.min_new_tokens or 0
        if held_back != setup.min_new_tokens:
            raise RuntimeError(
                f"run_trl: TRL's GenerationConfig has min_new_tokens={held_back}, not "
                f"{setup.min_new_tokens}; the "
                "shapes would differ from the other systems' (check generation_kwargs)"
            )
        trainer.remove_callback(transformers.PrinterCallback)  # logging is off: no summary
        clock.trainer = trainer
        trainer.train()
    return trl_steps(clock.bounds, records, setup.rows)


OVERLAPPED = {"rlblocks-async", "rlblocks-async-recompute"}
"""Systems whose rollout phase is only the wait for a generation that ran during the update:
no generation speed is reported for them."""

SYSTEMS: dict[str, System] = {
    "floor": run_floor,
    "rlblocks": run_rlblocks,
    "rlblocks-padded": partial(run_rlblocks, train={"packing": False}),
    "rlblocks-hf": partial(run_rlblocks, engine="hf"),
    "rlblocks-cb": partial(run_rlblocks, engine="cb"),
    "trl": run_trl,
    "rlblocks-async": partial(run_rlblocks, staleness=1, old_logprobs="rollout"),
    "rlblocks-async-recompute": partial(run_rlblocks, staleness=1, old_logprobs="recompute"),
    "rlblocks-recompute": partial(run_rlblocks, old_logprobs="recompute"),
}


# ---------------------------------------------------------------------- protocol and report
@dataclasses.dataclass
class Results:
    """Everything a run measured, and where to write it (``--out``)."""

    header: dict[str, Any]
    size: ModelSize
    matmul: float
    """FLOP/s of the reference matmul."""
    runs: dict[str, list[list[StepTime]]] = dataclasses.field(default_factory=dict)
    peaks: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    """Systems that raised under ``--keep-going``: their error."""
    out: Path | None = None


def run_round(
    setup: Setup, systems: Sequence[str], threads: int, results: Results, keep_going: bool = False
) -> None:
    """Each system once, in order. ``keep_going``: a system that fails is recorded with its
    error (traceback printed) and the next one runs; else the error stops the benchmark."""
    for name in systems:
        torch.set_num_threads(threads)
        torch.manual_seed(setup.seed)
        transformers.set_seed(setup.seed)
        try:
            with peak_memory(setup.device) as peak:
                steps = SYSTEMS[name](setup)
            check_shapes(name, steps, setup)
        except Skipped as reason:
            results.skipped[name] = str(reason)
            print(f"  {name:<15} skipped: {reason}", flush=True)
            continue
        except Exception as error:
            if not keep_going:
                raise
            traceback.print_exc()
            results.failed[name] = f"{type(error).__name__}: {error}"
            print(f"  {name:<15} failed: {results.failed[name]}", flush=True)
            write_results(results)
            continue
        finally:
            gc.collect()  # the previous system's model and optimizer go before the next loads
            if torch.device(setup.device).type == "cuda":
                torch.cuda.empty_cache()
        results.runs.setdefault(name, []).append(steps)
        results.peaks.setdefault(name, []).append(peak[0])
        timed = [s.seconds for s in steps[1:]] or [steps[0].seconds]
        print(
            f"  {name:<15} steps {' '.join(f'{s.seconds:6.2f}' for s in steps)} s   "
            f"median after warm-up {statistics.median(timed):6.2f} s",
            flush=True,
        )
        write_results(results)


def check_shapes(name: str, steps: list[StepTime], setup: Setup) -> None:
    """Fixed responses: every step has exactly rows × max_new_tokens response tokens. EOS
    responses: at most that, and a warning when no response ended early."""
    want = setup.rows * setup.max_new_tokens
    if setup.responses == "fixed":
        bad = [s.response_tokens for s in steps if s.response_tokens != want]
        if bad:
            raise RuntimeError(f"{name}: {bad} response tokens in a step, expected {want}")
        return
    bad = [s.response_tokens for s in steps if not 0 < s.response_tokens <= want]
    if bad:
        raise RuntimeError(f"{name}: {bad} response tokens in a step, expected 1 to {want}")
    if all(s.response_tokens == want for s in steps):
        print(f"  {name}: no response ended at EOS before {setup.max_new_tokens} tokens")


def summary(name: str, rounds: list[list[StepTime]], results: Results) -> dict[str, Any]:
    """Medians over the timed steps of one system (see the module docstring)."""
    timed = [s for steps in rounds for s in (steps[1:] or steps)]
    per_round = [statistics.median(s.seconds for s in (steps[1:] or steps)) for steps in rounds]
    rollouts = [s.response_tokens / s.phases["rollout"] for s in timed
                if s.phases["rollout"] > 0 and name not in OVERLAPPED]  # fmt: skip
    updates = [update_flops(results.size, s) / s.phases["update"] for s in timed
               if s.phases["update"] > 0 and s.trained]  # fmt: skip
    return {
        "seconds": statistics.median(s.seconds for s in timed),
        "spread": [min(per_round), max(per_round)],
        "phases": {p: statistics.median(s.phases[p] for s in timed) for p in PHASES},
        "other": statistics.median(s.seconds - sum(s.phases.values()) for s in timed),
        "tokens": statistics.median(s.tokens for s in timed),
        "response_tokens": statistics.median(s.response_tokens for s in timed),
        "padding": statistics.median(s.padding for s in timed),
        "generation_tokens_per_s": statistics.median(rollouts) if rollouts else None,
        "update_flops_per_s": statistics.median(updates) if updates else None,
        "mfu": statistics.median(updates) / results.matmul if updates else None,
        "peak_bytes": max(results.peaks[name]),
        "threads": sorted({s.threads for s in timed}),
    }


HEAD = ["system", "s/step", "spread", *PHASES, "other", "tok/step", "resp tok", "pad",
        "gen tok/s", "MFU", "peak GiB", "threads"]  # fmt: skip


def table(results: Results) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The markdown table's lines and each system's summary."""
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    summaries = {name: summary(name, rounds, results) for name, rounds in results.runs.items()}
    for name, s in summaries.items():
        cells = [
            name,
            f"{s['seconds']:.2f}",
            f"{s['spread'][0]:.2f}–{s['spread'][1]:.2f}",
            *(f"{s['phases'][p]:.2f}" for p in PHASES),
            f"{s['other']:.2f}",
            f"{s['tokens']:.0f}",
            f"{s['response_tokens']:.0f}",
            f"{100 * s['padding']:.1f}%",
            rate(s["generation_tokens_per_s"]),
            "—" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%",
            f"{s['peak_bytes'] / 2**30:.2f}",
            "/".join(str(t) for t in s["threads"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines, summaries


def rate(value: float | None) -> str:
    """Tokens per second for the table: whole above 100, three digits below, — for none."""
    if value is None:
        return "—"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def ratios(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """Seconds-per-step ratios between the systems, and the engines' generation speeds."""
    seconds = {name: s["seconds"] for name, s in summaries.items()}
    lines = []
    for a, b in (("rlblocks", "floor"), ("rlblocks-padded", "floor"),
                 ("rlblocks", "rlblocks-padded"), ("trl", "rlblocks"), ("trl", "floor")):  # fmt: skip
        if a in seconds and b in seconds:
            lines.append(f"{a} / {b}: {seconds[a] / seconds[b]:.2f}")
    for name, value in seconds.items():
        if name.startswith("rlblocks-") and name != "rlblocks-padded" and "rlblocks" in seconds:
            lines.append(f"{name} / rlblocks: {value / seconds['rlblocks']:.2f}")
        if name.startswith("rlblocks-async") and "trl" in seconds:
            lines.append(f"trl / {name}: {seconds['trl'] / value:.2f}")
    speeds = {n: s["generation_tokens_per_s"] for n, s in summaries.items()}
    for name in ("rlblocks", "rlblocks-cb"):
        if speeds.get(name) and speeds.get("rlblocks-hf"):
            lines.append(f"generation tokens/s, {name} / rlblocks-hf (HF generate): "
                         f"{speeds[name] / speeds['rlblocks-hf']:.2f}")  # fmt: skip
    return lines


def write_results(results: Results) -> dict[str, dict[str, Any]]:
    """Print nothing; write ``results.json`` and ``results.md`` into ``results.out`` (if set).
    Returns the summaries."""
    lines, summaries = table(results)
    if results.out is None:
        return summaries
    results.out.mkdir(parents=True, exist_ok=True)
    record = {
        **results.header,
        "matmul_flops_per_s": results.matmul,
        "model_size": dataclasses.asdict(results.size),
        "flops_formula": "6*N_body*T + 6*N_head*T_resp + 6*L*H*d_h*sum(n_i^2)",
        "skipped": results.skipped,
        "failed": results.failed,
        "systems": {
            name: {
                **summaries[name],
                "rounds": [[dataclasses.asdict(s) for s in steps] for steps in rounds],
            }
            for name, rounds in results.runs.items()
        },
        "ratios": ratios(summaries),
    }
    (results.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    skipped = [f"- {name}: skipped ({why})" for name, why in results.skipped.items()]
    skipped += [f"- {name}: failed ({why})" for name, why in results.failed.items()]
    text = [results.header["title"], "", *lines, "", *ratios(summaries), "", *skipped]
    (results.out / "results.md").write_text("\n".join(text).rstrip() + "\n")
    return summaries


def print_report(results: Results) -> dict[str, float]:
    """The markdown table and the ratios; the median seconds per step of each system back."""
    lines, summaries = table(results)
    print("\n" + "\n".join(lines) + "\n")
    for line in ratios(summaries):
        print(line)
    return {name: s["seconds"] for name, s in summaries.items()}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="built-in name, folder, qwen2-0.5b-random or smollm2-135m-random")  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="steps per run, the first a warm-up")
    p.add_argument("--repeats", type=int, default=2, help="rounds over the systems")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest response")
    p.add_argument("--responses", choices=["fixed", "eos"], default="fixed",
                   help="fixed: every response max-new-tokens long; eos: they end at EOS")  # fmt: skip
    p.add_argument("--eos-hazard", type=float, default=None,
                   help="random models, --responses eos: P(EOS) at every position "
                        "(default 4 / max-new-tokens, at most 0.5)")  # fmt: skip
    p.add_argument("--beta", type=float, default=0.0, help="KL loss coefficient (k3)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=default_device(), help="default: cuda when available")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="the model's weights")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="rows per forward/backward of the update (default: the whole batch)")  # fmt: skip
    p.add_argument("--matmul-size", type=int, default=None,
                   help="n of the reference n×n×n matmul (default 8192 on a GPU, 1024 on a CPU)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write results.json / results.md here")
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="a system that fails is recorded and the others run; exit status 1 at the end",
    )
    p.add_argument(
        "--systems",
        nargs="+",
        default=["floor", "rlblocks", "trl", "rlblocks-async"],
        choices=list(SYSTEMS),
    )
    args = p.parse_args(argv)
    if min(args.steps, args.repeats, args.prompts, args.max_new_tokens) < 1 or args.group_size < 2:
        p.error("--steps, --repeats, --prompts, --max-new-tokens >= 1; --group-size >= 2")
    if args.micro_batch is not None and args.micro_batch < 1:
        p.error(f"--micro-batch {args.micro_batch}: pass a positive row count")
    if args.eos_hazard is not None and not 0 < args.eos_hazard < 1:
        p.error(f"--eos-hazard {args.eos_hazard}: pass a probability in (0, 1)")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device; pass --device cpu")
    return args


def versions(systems: Sequence[str]) -> str:
    found = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if "trl" in systems:  # importing it takes seconds
        with contextlib.suppress(ImportError):
            import trl

            found += f", trl {trl.__version__}"
    return found


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return "CPU"


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    # The process's malloc setting is shared by every system run here: apply rlblocks' (a CPU
    # PolicyTrainer would at its first run) before any, so that no system runs without it.
    kept = keep_freed_memory()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    data = arithmetic_prompts(args.steps * args.prompts, seed=args.seed, chat=True)
    batches = PromptBatches(data, prompts_per_step=args.prompts, seed=0)
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory(prefix="grpo-step-model-") as folder:
        setup = Setup(
            model=prepare_model(args, Path(folder)),
            batches=tuple(b for b, _ in zip(batches, range(args.steps))),
            group_size=args.group_size,
            max_new_tokens=args.max_new_tokens,
            lr=args.lr,
            beta=args.beta,
            seed=args.seed,
            responses=args.responses,
            device=args.device,
            dtype=dtype,
            micro_batch=args.micro_batch,
        )
        torch.set_num_threads(args.threads)
        n = args.matmul_size or (8192 if torch.device(args.device).type == "cuda" else 1024)
        results = Results(header={}, size=model_size(setup.model),
                          matmul=matmul_flops(args.device, dtype, n), out=args.out)  # fmt: skip
        hazard = eos_hazard(args) if setup.model != args.model else None
        title = (
            f"{args.model}, {args.dtype}, {device_name(args.device)}, {args.threads} thread(s); "
            f"{args.prompts} prompts x {args.group_size} samples x at most {args.max_new_tokens} "
            f"new tokens ({args.responses} responses"
            + (f", EOS hazard {hazard:.3g}" if hazard else "")
            + f"), micro-batch {args.micro_batch or 'whole'}, beta {args.beta}; {args.steps} "
            f"steps per run (first one warm-up), {args.repeats} rounds; "
            f"{results.size.parameters / 1e6:.1f}M parameters; {n}^3 {args.dtype} matmul "
            f"{results.matmul / 1e12:.3g} TFLOP/s; {versions(args.systems)}; freed memory kept "
            f"for reuse (rlblocks.trainer.allocator): {kept}"
        )
        results.header = {"title": title, "argv": list(argv) if argv is not None else sys.argv[1:],
                          "device": device_name(args.device), "dtype": args.dtype,
                          "responses": args.responses, "eos_hazard": hazard,
                          "matmul_size": n}  # fmt: skip
        print(title, flush=True)
        for r in range(args.repeats):
            order = args.systems[r % len(args.systems) :] + args.systems[: r % len(args.systems)]
            print(f"round {r + 1}: {', '.join(order)}", flush=True)
            run_round(setup, order, args.threads, results, args.keep_going)
    write_results(results)
    medians = print_report(results)
    if results.failed:
        raise SystemExit(
            f"grpo_step: {len(results.failed)} system(s) failed: "
            + "; ".join(f"{name}: {why}" for name, why in results.failed.items())
            + "; see their tracebacks above"
        )
    return medians


if __name__ == "__main__":
    main()
