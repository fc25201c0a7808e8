"""``rb.plan`` against measured peaks: predicted, measured and the error per configuration.

    OMP_NUM_THREADS=1 python benchmarks/memory_plan.py                 # every configuration
    python benchmarks/memory_plan.py --only tiny --out runs/memory-plan  # names containing "tiny"
    python benchmarks/memory_plan.py --device cuda --out DIR              # the GPU set, ±10%

Each configuration trains a random-init model of a given shape with ``PolicyTrainer`` for two
steps (the first creates the optimizer's moments, so the second holds everything a steady
step holds), each step two micro-batches of ``tokens`` real tokens per rank (rows of 128
tokens: 16 of prompt, 112 of response), with the clipped surrogate loss. The measured peak is
the most tensor memory alive at once over the whole run, model building included: torch's
profiler with ``profile_memory=True`` records every allocation and free of the process's
tensors (on a CPU, the c10 allocator's), and the running sum's maximum is the peak. It counts
tensors only, as the plan does (not the interpreter, not the libraries' code). A 2-rank
configuration runs two gloo processes, FSDP2 over both; its peak is the larger rank's.

Every configuration runs in its own spawned process (nothing left over from the one before).
The plan is ``rb.plan(..., engine=None)``: the trainer's parts. The bound is ±15% on a CPU;
the script exits 1 when a configuration is outside it.

``--device cuda`` runs ``GPU_CONFIGS`` instead: a random-init Qwen2.5-0.5B-shaped model in
bf16, on the GPU, its peak read from ``torch.cuda.max_memory_allocated`` (torch's caching
allocator: every tensor, none of the CUDA context), bound ±10%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BOUND = {"cpu": 0.15, "cuda": 0.10}
ROW = 128  # tokens per row: 16 of prompt, 112 of response
PROMPT = 16


@dataclass(frozen=True)
class Config:
    name: str
    model: str  # "tiny" or a shape of grpo_step.RANDOM_MODELS
    tokens: int
    lora: int | None = None  # LoRA rank (all linear layers) or full fine-tuning
    checkpointing: bool = False
    world: int = 1
    dtype: str = "fp32"
    device: str = "cpu"


CONFIGS = (
    Config("tiny, full", "tiny", 1024),
    Config("tiny, full, 4096 tokens", "tiny", 4096),
    Config("tiny, LoRA r8", "tiny", 2048, lora=8),
    Config("tiny, full, checkpointing", "tiny", 4096, checkpointing=True),
    Config("tiny, full, 2 ranks", "tiny", 2048, world=2),
    Config("smollm2-135m shape, full", "smollm2-135m-random", 512),
    Config("smollm2-135m shape, full, 1024 tokens", "smollm2-135m-random", 1024),
    Config("smollm2-135m shape, LoRA r16", "smollm2-135m-random", 1024, lora=16),
    Config("smollm2-135m shape, checkpointing", "smollm2-135m-random", 1024, checkpointing=True),
    Config("smollm2-135m shape, full, 2 ranks", "smollm2-135m-random", 512, world=2),
)


GPU_CONFIGS = tuple(
    Config(name, "qwen2-0.5b-random", tokens, dtype="bf16", device="cuda", **extra)
    for name, tokens, extra in (
        ("qwen2-0.5b shape, bf16, full, 4096 tokens", 4096, {}),
        ("qwen2-0.5b shape, bf16, full, 8192 tokens", 8192, {}),
        ("qwen2-0.5b shape, bf16, checkpointing, 8192 tokens", 8192, {"checkpointing": True}),
        ("qwen2-0.5b shape, bf16, LoRA r16, 8192 tokens", 8192, {"lora": 16}),
        ("qwen2-0.5b shape, bf16, full, 16384 tokens", 16384, {}),
    )
)


def model_config(name: str):
    import rlblocks as rb

    tokenizer = rb.models.tiny_tokenizer()
    if name == "tiny":
        return rb.models.tiny_config(tokenizer), tokenizer
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grpo_step import RANDOM_MODELS

    return rb.models.tiny_config(tokenizer, **RANDOM_MODELS[name]), tokenizer


def lora_config(rank: int | None):
    if rank is None:
        return None
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)


def predict(config: Config) -> tuple[int, str]:
    import rlblocks as rb

    model, _ = model_config(config.model)
    model._attn_implementation = "sdpa"
    planned = rb.plan(
        model,
        dtype=config.dtype,
        lora=lora_config(config.lora),
        gradient_checkpointing=config.checkpointing,
        tokens=config.tokens,
        world=config.world,
        engine=None,
        device_memory=None,
    )
    return planned.peaks["trainer"], planned.table()


def measure_rank(rank: int, config: Config, store: str, out: str) -> None:
    """One rank's run under the memory profiler; writes its peak to ``out``-<rank>."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    if config.world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=config.world)  # fmt: skip
    from functools import partial

    from transformers import Qwen2ForCausalLM

    import rlblocks as rb

    hf_config, _ = model_config(config.model)
    hf_config._attn_implementation = "sdpa"
    rows = 2 * config.tokens // ROW * config.world  # two micro-batches per rank
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, hf_config.vocab_size, (rows, PROMPT), generator=g).tolist()
    responses = torch.randint(3, hf_config.vocab_size, (rows, ROW - PROMPT), generator=g).tolist()
    ro = rb.Rollouts.from_lists(prompts, responses, pad_token_id=0).to(config.device)
    advantages = torch.randn(rows, generator=g).to(config.device)
    loss = partial(rb.losses.clipped_surrogate, clip=(0.2, 0.2))
    cuda = config.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=not cuda) as prof:
        torch.manual_seed(0)
        dtype = rb.planner.sizing.DTYPES[config.dtype]
        torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy first
        try:
            with torch.device(config.device):
                model = Qwen2ForCausalLM(hf_config)
        finally:
            torch.set_default_dtype(torch.float32)
        trainer = rb.trainer.PolicyTrainer(
            model,
            lr=1e-5,
            lora=lora_config(config.lora),
            micro_batch_tokens=config.tokens,
            gradient_checkpointing=config.checkpointing,
        )
        if config.world > 1:
            trainer.shard()
        ro = ro.replace(old_logprobs=trainer.logprobs(ro))
        for _ in range(2):
            trainer.step(ro, advantages, loss_fn=loss)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    Path(f"{out}-{rank}").write_text(json.dumps({"peak": peak, "events": len(events)}))
    if config.world > 1:
        torch.distributed.destroy_process_group()


def measure(config: Config) -> int:
    """The measured peak (bytes, the larger rank's), each rank in a spawned process."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="memory-plan-") as folder:
        store, out = os.path.join(folder, "store"), os.path.join(folder, "peak")
        procs = [context.Process(target=measure_rank, args=(r, config, store, out))
                 for r in range(config.world)]  # fmt: skip
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"memory_plan: {config.name}: rank(s) {failed} failed (above)")
        return max(json.loads(Path(f"{out}-{r}").read_text())["peak"]
                   for r in range(config.world))  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--only", help="run the configurations whose name contains this")
    p.add_argument("--out", type=Path, help="write results.json and results.md there")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the configurations and their plans, measure nothing (any machine)",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: CONFIGS, profiler peaks; cuda: GPU_CONFIGS, CUDA peaks")  # fmt: skip
    args = p.parse_args(argv)
    every = GPU_CONFIGS if args.device == "cuda" else CONFIGS
    configs = [c for c in every if args.only is None or args.only in c.name]
    if not configs:
        p.error(f"--only {args.only!r} matches no configuration: {[c.name for c in every]}")
    import torch

    rows = []
    bound = BOUND[args.device]
    gpu = args.device == "cuda" and not args.dry_run
    where = torch.cuda.get_device_name() if gpu else f"{os.cpu_count()} CPU(s)"
    print(f"torch {torch.__version__}, {where}; bound ±{bound:.0%}", flush=True)
    for config in configs:
        start = time.perf_counter()
        predicted, _ = predict(config)
        if args.dry_run:
            print(f"  {config.name:45s} predicted {predicted / 2**20:9.1f} MiB (dry run)")
            continue
        measured = measure(config)
        error = predicted / measured - 1
        row = {**dataclasses.asdict(config), "predicted": predicted, "measured": measured,
               "error": error, "seconds": time.perf_counter() - start}  # fmt: skip
        rows.append(row)
        print(f"  {config.name:45s} predicted {predicted / 2**20:9.1f} MiB  measured "
              f"{measured / 2**20:9.1f} MiB  error {error:+6.1%}", flush=True)  # fmt: skip
    if args.dry_run:
        return rows
    table = ["| configuration | predicted MiB | measured MiB | error |", "|---|---|---|---|"]
    table += [f"| {r['name']} | {r['predicted'] / 2**20:.1f} | {r['measured'] / 2**20:.1f} | "
              f"{r['error']:+.1%} |" for r in rows]  # fmt: skip
    print("\n" + "\n".join(table))
    outside = [r["name"] for r in rows if abs(r["error"]) > bound]
    print(f"\n{len(rows) - len(outside)} of {len(rows)} within ±{bound:.0%}"
          + (f"; outside: {', '.join(outside)}" if outside else ""))  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=1))
        (args.out / "results.md").write_text("\n".join(table) + "\n")
    if outside and argv is None:
        sys.exit(1)
    return rows


if __name__ == "__main__":
    main()
