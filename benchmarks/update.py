"""How fast is the policy update alone, compiled and eager, next to a matmul of the machine?

    OMP_NUM_THREADS=1 python benchmarks/update.py --threads 1            # the main job's shape, CPU
    python benchmarks/update.py --model qwen2-0.5b-random --dtype bfloat16 --device cuda \\
        --tokens 4096,16384,65536 --out runs/update                       # a GPU

The rows are already generated: synthetic rollouts of random token ids (seeded), groups of
``--group-size`` rows sharing a prompt length drawn from ``--prompt-tokens`` (a range), each
response 1 to ``--max-new-tokens`` tokens long (uniform), as many groups as make ``--tokens``
real tokens per step exactly (the last group's responses, then prompts, trimmed to fit).
Defaults: on a CPU the main job's shape (``examples/grpo_arithmetic.yaml``: 8 prompts × 6
samples of SmolLM2-135M, its arithmetic chat prompts 43 to 62 tokens with SmolLM2's template,
at most 32 new tokens: 3264 tokens is about 48 rows) on ``smollm2-135m-random`` (random weights
of that shape, ``benchmarks/grpo_step.py``); on a GPU 4k, 16k and 64k tokens of prompts of 64 to
256 and responses of up to 1024 tokens. Advantages are random, one per row (normal, seeded).

**Systems** (``--systems``), each on the same rows:

- **eager**: ``PolicyTrainer(model, reference=None, compile=False, micro_batch_tokens=...)``
  and ``step(rows, advantages, loss_fn=partial(rb.losses.clipped_surrogate, clip=(0.2,
  0.28)))``: DAPO's clip-higher, token-mean, one optimizer step over all rows, so π_old is the
  detached log-prob of the update's own forward (no scoring pass); gradient norm clipped to 1,
  AdamW. ``bf16`` is TrainConfig's default (on for a float32 model on a GPU).
- **compiled**: the same with ``compile=True``: every decoder block compiled
  (``rlblocks.models.regional``), one graph for every token count.
- **trl**: ``trl.GRPOTrainer``'s update on the same rows (skipped without trl): its
  ``_generate_and_score_completions`` is replaced by one that hands back these rows (prompt
  left-padded, completion right-padded, the advantages, the token count), so ``train()`` runs
  only the update: ``per_device_train_batch_size`` rows a micro-batch (as many micro-batches as
  rlblocks' token budget makes, rounded to a divisor of the rows), padded rows, ``loss_type
  ="dapo"``, ε = (0.2, 0.28), no gradient checkpointing, ``bf16`` when the run's dtype is.
  Timed from TRL's ``on_step_begin`` to ``on_step_end``. If TRL's internals differ from what
  this drives, the row is printed "not measured" with the error; no number is made up.

**Measured** per system and token count: seconds per step (median of ``--steps`` timed steps,
after ``--warmup`` untimed ones; the first warm-up of ``compiled`` holds inductor's compile,
shown as ``first s``), tokens/s, the update's model FLOPs (``grpo_step.update_flops``:
6·N_body·T + 6·N_head·T_resp + 6·L·H·d_h·Σnᵢ²) per second, and that over the FLOP/s of a
``--matmul-size`` square matmul in the run's dtype measured in the same run (``MFU``), and
over the FLOP/s of the update's own products at their own shapes (``of same-shape``:
:func:`same_shape_flops`, each linear's forward, input and weight gradient at the
micro-batch's token count, FLOP-weighted; measured in the same run); peak
memory of the timed steps (``torch.cuda.max_memory_allocated``, or the process's peak resident
set on a CPU, ``grpo_step.peak_memory``). ``--profile N``: the N aten operators one compiled
step spends most time in (after the timed steps). ``--out DIR`` writes ``update.json`` and
``update.md``, rewritten after every row so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

import rlblocks as rb

sys.path.insert(0, str(Path(__file__).parent))
from grpo_step import (
    RANDOM_MODELS,
    StepTime,
    build_random_model,
    gemm_flops,
    matmul_flops,
    model_size,
    peak_memory,
    print_profile,
    sync,
    update_flops,
)

CLIP = (0.2, 0.28)  # DAPO clip-higher
SYSTEMS = ("eager", "compiled", "trl")
MAIN_JOB_TOKENS = 3264  # 48 rows (8 prompts x 6) x (51 prompt + 17 response tokens) on average


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: a system at one token count."""

    system: str
    tokens: int
    rows: int
    first_s: float
    """The first warm-up step (inductor compiles in it)."""
    seconds: list[float]
    flops: float
    """Model FLOPs of one update on these rows."""
    peak_bytes: int
    note: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


# ---------------------------------------------------------------------- rows
def row_lengths(
    tokens: int, *, group_size: int, prompt: tuple[int, int], max_new: int, seed: int
) -> list[tuple[int, int]]:
    """(prompt, response) lengths of whole groups totalling exactly ``tokens`` real tokens."""
    generator = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = []
    while sum(p + r for p, r in rows) < tokens:
        p = int(torch.randint(prompt[0], prompt[1] + 1, (), generator=generator))
        rows += [[p, int(torch.randint(1, max_new + 1, (), generator=generator))]
                 for _ in range(group_size)]  # fmt: skip
    excess = sum(p + r for p, r in rows) - tokens
    last = rows[-group_size:]
    if sum(p + r for p, r in last) - excess < 2 * group_size:  # too little left for a group
        rows = rows[:-group_size]
        rows[-1][1] += tokens - sum(p + r for p, r in rows)  # a longer response, not a new row
        return [(p, r) for p, r in rows]
    for field in (1, 0):  # trim responses first, then prompts, each down to 1 token
        for row in reversed(last):
            cut = min(excess, row[field] - 1)
            row[field] -= cut
            excess -= cut
    return [(p, r) for p, r in rows]


def synthetic_rollouts(
    lengths: list[tuple[int, int]], *, vocab: int, group_size: int, seed: int, device: str
) -> rb.Rollouts:
    """Random ids in ``lengths``' shape: prompts left-padded, responses right-padded."""
    generator = torch.Generator().manual_seed(seed)
    b, tp, t = len(lengths), max(p for p, _ in lengths), max(r for _, r in lengths)
    prompt_ids = torch.zeros(b, tp, dtype=torch.long)
    response_ids = torch.zeros(b, t, dtype=torch.long)
    prompt_mask = torch.zeros(b, tp, dtype=torch.bool)
    response_mask = torch.zeros(b, t, dtype=torch.bool)
    for i, (p, r) in enumerate(lengths):
        prompt_ids[i, tp - p :] = torch.randint(1, vocab, (p,), generator=generator)
        response_ids[i, :r] = torch.randint(1, vocab, (r,), generator=generator)
        prompt_mask[i, tp - p :] = True
        response_mask[i, :r] = True
    return rb.Rollouts(
        prompt_ids=prompt_ids.to(device),
        response_ids=response_ids.to(device),
        attention_mask=torch.cat([prompt_mask, response_mask], 1).to(device),
        response_mask=response_mask.to(device),
        group_ids=(torch.arange(b) // group_size).to(device),
    )


# ---------------------------------------------------------------------- systems
def timed_steps(
    step: Callable[[], Any], args: argparse.Namespace
) -> tuple[float, list[float], int]:
    """First warm-up seconds, timed seconds, peak bytes of the timed steps."""
    first = 0.0
    for i in range(args.warmup):
        start = time.perf_counter()
        step()
        sync(args.device)
        first = first or time.perf_counter() - start
    seconds = []
    with peak_memory(args.device) as peak:
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            sync(args.device)
            seconds.append(time.perf_counter() - start)
    return first, seconds, peak[0]


def run_rlblocks(
    compiled: bool, path: str, batches: dict[int, tuple[rb.Rollouts, torch.Tensor]],
    args: argparse.Namespace, report: Callable[[Row], None],
) -> None:  # fmt: skip
    """Every token count on one trainer (one compile for all of them: dynamic shapes)."""
    policy = rb.trainer.PolicyTrainer.from_pretrained(
        path, dtype=args.torch_dtype, device=args.device, reference=None, lr=args.lr,
        compile=compiled, micro_batch_tokens=args.micro_batch_tokens,
    )  # fmt: skip
    loss = partial(rb.losses.clipped_surrogate, clip=CLIP)
    name = "compiled" if compiled else "eager"
    for tokens, (rollouts, advantages) in batches.items():
        step = partial(policy.step, rollouts, advantages, loss_fn=loss)
        first, seconds, peak = timed_steps(step, args)
        report(Row(name, tokens, len(rollouts), first, seconds, args.flops[tokens], peak,
                   f"bf16 autocast {policy.config.bf16}"))  # fmt: skip
    if compiled and args.profile:
        rollouts, advantages = batches[max(batches)]
        heading = "profile of one compiled step, {wall:.2f} s under the profiler:"
        print_profile(
            heading, partial(policy.step, rollouts, advantages, loss_fn=loss), args.profile
        )


def trl_micro_rows(rows: int, tokens: int, budget: int) -> int:
    """Rows per TRL micro-batch: as many micro-batches as rlblocks' token budget makes, the
    rows per micro-batch rounded up to a divisor of ``rows`` (TRL splits evenly)."""
    want = -(-rows // -(-tokens // budget))
    return next(d for d in range(want, rows + 1) if rows % d == 0)


def run_trl(
    path: str, batches: dict[int, tuple[rb.Rollouts, torch.Tensor]],
    args: argparse.Namespace, report: Callable[[Row], None],
) -> None:  # fmt: skip
    """TRL's update alone on each token count's rows (module docstring), a fresh model each."""
    import datasets  # noqa: F401  # ImportError here: the row is "not measured"
    import trl  # noqa: F401

    for tokens, (ro, advantages) in batches.items():
        report(trl_update(path, tokens, ro, advantages, args))
        gc.collect()


class StepClock(transformers.TrainerCallback):
    """Seconds of every optimizer step, ``on_step_begin`` to ``on_step_end``, device synced."""

    def __init__(self, device: str) -> None:
        self.device, self.times = device, []

    def on_step_begin(self, *_: Any, **__: Any) -> None:
        sync(self.device)
        self.begin = time.perf_counter()

    def on_step_end(self, *_: Any, **__: Any) -> None:
        sync(self.device)
        self.times.append(time.perf_counter() - self.begin)


def trl_update(
    path: str, tokens: int, ro: rb.Rollouts, advantages: torch.Tensor, args: argparse.Namespace
) -> Row:
    """``GRPOTrainer.train()`` whose generation hands back ``ro``: only its update runs."""
    import datasets
    import trl

    model, tokenizer = rb.models.load(path, dtype=args.torch_dtype, device=args.device)
    rows, g = len(ro), args.group_size
    micro = trl_micro_rows(rows, tokens, args.micro_batch_tokens)
    inputs = {
        "prompt_ids": ro.prompt_ids, "prompt_mask": ro.attention_mask[:, : ro.prompt_ids.shape[1]].long(),
        "completion_ids": ro.response_ids, "completion_mask": ro.response_mask.long(),
        "advantages": advantages, "num_items_in_batch": ro.response_mask.sum().float(),
    }  # fmt: skip
    clock, steps = StepClock(args.device), args.warmup + args.steps
    data = [{"prompt": "x"} for _ in range(steps * rows // g)]  # one generation batch a step
    with tempfile.TemporaryDirectory() as folder, peak_memory(args.device) as peak:
        config = trl.GRPOConfig(
            output_dir=folder, max_steps=steps, seed=args.seed, shuffle_dataset=False,
            per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
            generation_batch_size=rows, num_generations=g, max_completion_length=ro.response_ids.shape[1],
            beta=0.0, epsilon=CLIP[0], epsilon_high=CLIP[1], loss_type="dapo",
            learning_rate=args.lr, lr_scheduler_type="constant", gradient_checkpointing=False,
            use_cpu=torch.device(args.device).type == "cpu", bf16=args.torch_dtype == torch.bfloat16,
            disable_tqdm=True, report_to="none", logging_strategy="no", save_strategy="no",
            eval_strategy="no",
        )  # fmt: skip
        trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0],
                                  args=config, processing_class=tokenizer,
                                  train_dataset=datasets.Dataset.from_list(data),
                                  callbacks=[clock])  # fmt: skip
        trainer._generate_and_score_completions = lambda batch: dict(inputs)  # the rows
        trainer.remove_callback(transformers.PrinterCallback)
        trainer.train()
    # the peak covers model loading and the warm-up too: TRL's steps run in one train() call
    return Row("trl", tokens, rows, clock.times[0], clock.times[args.warmup :],
               args.flops[tokens], peak[0], f"{rows // micro} x {micro} padded rows")  # fmt: skip


# ---------------------------------------------------------------------- the same-shape matmul
def same_shape_flops(path: str, device: str, dtype: torch.dtype, tokens: int, responses: int,
                     chunk: int = 1024) -> float:  # fmt: skip
    """FLOP/s of the update's own matrix products at their own shapes, FLOP-weighted, for one
    micro-batch of ``tokens`` tokens of which ``responses`` are response tokens: every
    ``nn.Linear`` of every decoder layer over the ``tokens``, and the LM head over the
    ``responses`` in chunks of at most ``chunk``; each forward (X·Wᵀ), input gradient (dY·W)
    and weight gradient (dYᵀ·X). The rate is Σ FLOPs / Σ (FLOPs_i / rate_i): what an update
    made of those products alone would reach on this machine."""
    config = transformers.AutoConfig.from_pretrained(rb.models.resolve(path))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    head = model.get_output_embeddings()
    # (FLOPs of one product in the micro-batch, its m, in, out)
    jobs = [(2 * tokens * m.in_features * m.out_features * config.num_hidden_layers, tokens,
             m.in_features, m.out_features)
            for m in layer.modules() if isinstance(m, nn.Linear)]  # fmt: skip
    rows = max(min(chunk, responses), 1)
    jobs.append((2 * responses * head.in_features * head.out_features, rows,
                 head.in_features, head.out_features))  # fmt: skip
    flops = seconds = 0.0
    for work, m, k, n in jobs:
        for shape in ((m, k, n), (m, n, k), (n, m, k)):  # forward, input grad, weight grad
            flops += work
            seconds += work / gemm_flops(device, dtype, *shape, repeats=3, warmups=1)
    return flops / seconds


# ---------------------------------------------------------------------- report
HEAD = ("system", "tokens", "rows", "first s", "s/step", "min s", "tok/s", "TFLOP/s", "MFU",
        "of same-shape", "peak GiB", "note")  # fmt: skip


def table(rows: list[Row], matmul: float, same: dict[int, float],
          missing: dict[str, str]) -> list[str]:  # fmt: skip
    """Markdown lines: one per measured row, then one per system not measured. ``MFU``: over
    the square matmul; ``of same-shape``: over the update's own products (same_shape_flops)."""
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for r in rows:
        rate = r.flops / r.median_s
        cells = (r.system, str(r.tokens), str(r.rows), f"{r.first_s:.2f}", f"{r.median_s:.3f}",
                 f"{min(r.seconds):.3f}", f"{r.tokens / r.median_s:.0f}", f"{rate / 1e12:.3g}",
                 f"{100 * rate / matmul:.1f}%", f"{rate / same[r.tokens]:.2f}",
                 f"{r.peak_bytes / 2**30:.2f}", r.note)  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for name, why in missing.items():
        lines.append(f"| {name} | not measured: {why} |")
    return lines


def ratios(rows: list[Row]) -> list[str]:
    """compiled / eager and trl / eager seconds per step at each token count."""
    found = {(r.system, r.tokens): r.median_s for r in rows}
    lines = []
    for name in ("compiled", "trl"):
        for (system, tokens), seconds in found.items():
            if system == name and ("eager", tokens) in found:
                lines.append(f"{name} / eager at {tokens} tokens: "
                             f"{seconds / found['eager', tokens]:.2f}")  # fmt: skip
    return lines


def write(args: argparse.Namespace, header: dict, rows: list[Row], missing: dict) -> list[str]:
    """The table and ratios; into ``--out`` as update.md / update.json when given."""
    same = {int(t): v for t, v in header["same_shape_flops_per_s"].items()}
    lines = table(rows, header["matmul_flops_per_s"], same, missing) + [""] + ratios(rows)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "update.md").write_text("\n".join([header["title"], "", *lines]) + "\n")
        record = {**header, "not_measured": missing, "ratios": ratios(rows), "rows": [
            dataclasses.asdict(r) | {"median_s": r.median_s, "tokens_per_s": r.tokens / r.median_s,
                                     "flops_per_s": r.flops / r.median_s,
                                     "mfu": r.flops / r.median_s / header["matmul_flops_per_s"],
                                     "of_same_shape": r.flops / r.median_s / same[r.tokens]}
            for r in rows]}  # fmt: skip
        (args.out / "update.json").write_text(json.dumps(record, indent=1) + "\n")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-random",
                   help=f"built-in name, folder, or one of {sorted(RANDOM_MODELS)}")  # fmt: skip
    p.add_argument("--dtype", default="float32", help="the weights' torch dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default=None,
                   help=f"real tokens per step, a comma list (default 4096,16384,65536 on a GPU, "
                        f"{MAIN_JOB_TOKENS} on a CPU: the main job's batch)")  # fmt: skip
    p.add_argument(
        "--prompt-tokens",
        default=None,
        help="prompt lengths lo,hi (default 43,62 on a CPU, 64,256 on a GPU)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="longest response (default 32 on a CPU, 1024 on a GPU)",
    )
    p.add_argument("--group-size", type=int, default=6, help="rows per prompt")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="real tokens per forward/backward (default 1024 CPU, 16384 GPU)",
    )
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--threads", type=int, default=cores, help=f"CPU threads (default {cores})")
    p.add_argument(
        "--matmul-size",
        type=int,
        default=None,
        help="n of the reference n×n×n matmul (default 8192 GPU, 1024 CPU)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="print the N aten operators of one compiled step",
    )
    p.add_argument("--out", type=Path, default=None, help="write update.json / update.md here")
    args = p.parse_args(argv)
    gpu = torch.device(args.device).type == "cuda"
    if gpu and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device; pass --device cpu")
    args.torch_dtype = getattr(torch, args.dtype, None)
    if not isinstance(args.torch_dtype, torch.dtype):
        p.error(f"--dtype {args.dtype!r} is not a torch dtype; pass float32 or bfloat16")
    args.tokens = [int(t) for t in (args.tokens or ("4096,16384,65536" if gpu
                                                    else str(MAIN_JOB_TOKENS))).split(",")]  # fmt: skip
    lo, hi = (int(n) for n in (args.prompt_tokens or ("64,256" if gpu else "43,62")).split(","))
    args.prompt_tokens = (lo, hi)
    args.max_new_tokens = args.max_new_tokens or (1024 if gpu else 32)
    args.micro_batch_tokens = args.micro_batch_tokens or (16384 if gpu else 1024)
    if min(lo, args.max_new_tokens, args.warmup, args.steps, *args.tokens) < 1 or lo > hi:
        p.error("--tokens, --prompt-tokens lo <= hi, --max-new-tokens, --warmup, --steps >= 1")
    if args.group_size < 2 or min(args.tokens) < 2 * args.group_size:
        p.error(f"--group-size >= 2 and every --tokens >= 2 x group size; got {args.group_size}")
    return args


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    rows: list[Row] = []
    missing: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="update-model-") as folder:
        path = args.model
        if args.model in RANDOM_MODELS:
            path = build_random_model(args.model, Path(folder), seed=args.seed, hazard=None,
                                      dtype=args.torch_dtype, device=args.device)  # fmt: skip
        size = model_size(path)
        vocab = transformers.AutoConfig.from_pretrained(rb.models.resolve(path)).vocab_size
        batches, args.flops = {}, {}
        for tokens in args.tokens:
            lengths = row_lengths(tokens, group_size=args.group_size, prompt=args.prompt_tokens,
                                  max_new=args.max_new_tokens, seed=args.seed + tokens)  # fmt: skip
            ro = synthetic_rollouts(lengths, vocab=vocab, group_size=args.group_size,
                                    seed=args.seed + tokens, device=args.device)  # fmt: skip
            generator = torch.Generator().manual_seed(args.seed)
            batches[tokens] = (ro, torch.randn(len(ro), generator=generator).to(args.device))
            shape = StepTime(0.0, {}, tokens, sum(r for _, r in lengths), args.threads,
                             trained=tokens, trained_sq=sum((p + r) ** 2 for p, r in lengths))  # fmt: skip
            args.flops[tokens] = update_flops(size, shape)
        n = args.matmul_size or (8192 if torch.device(args.device).type == "cuda" else 1024)
        matmul = matmul_flops(args.device, args.torch_dtype, n)
        same = {}
        for tokens, (ro, _) in batches.items():  # the update's own products, one micro-batch
            m = min(args.micro_batch_tokens, tokens)
            share = ro.response_attention_mask.sum().item() / tokens
            same[tokens] = same_shape_flops(
                path, args.device, args.torch_dtype, m, round(m * share)
            )
        title = (
            f"{args.model} ({size.parameters / 1e6:.1f}M parameters), {args.dtype} on {args.device}, "
            f"{args.threads} thread(s); tokens per step {args.tokens}, prompts "
            f"{args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, responses 1-"
            f"{args.max_new_tokens}, groups of {args.group_size}, micro-batches of "
            f"{args.micro_batch_tokens} tokens; {args.warmup} warm-up + {args.steps} timed steps; "
            f"{n}^3 matmul {matmul / 1e12:.3g} TFLOP/s; the update's own products "
            + ", ".join(f"{same[t] / 1e12:.3g}" for t in args.tokens)
            + f" TFLOP/s; torch {torch.__version__}, "
            f"transformers {transformers.__version__}"
        )
        print(title, flush=True)
        header = {"title": title, "argv": list(argv) if argv is not None else sys.argv[1:],
                  "matmul_flops_per_s": matmul, "matmul_size": n, "threads": args.threads,
                  "same_shape_flops_per_s": same,
                  "model_size": dataclasses.asdict(size)}  # fmt: skip

        def report(row: Row) -> None:
            rows.append(row)
            print(f"  {row.system} at {row.tokens} tokens: first {row.first_s:.2f} s, "
                  f"{row.median_s:.3f} s/step", flush=True)  # fmt: skip
            write(args, header, rows, missing)

        for name in args.systems:
            try:
                if name == "trl":
                    run_trl(path, batches, args, report)
                else:
                    run_rlblocks(name == "compiled", path, batches, args, report)
            except ImportError as error:
                missing[name] = f"{error}; pip install 'rlblocks[bench]'"
            except Exception as error:  # the others still run; reason recorded
                if name != "trl":
                    raise
                traceback.print_exc()
                missing[name] = f"driving TRL's update failed: {type(error).__name__}: {error}"
            gc.collect()
            if torch.device(args.device).type == "cuda":
                torch.cuda.empty_cache()
    print("\n".join(write(args, header, rows, missing)))
    return rows


if __name__ == "__main__":
    main()
