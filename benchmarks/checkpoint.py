"""What does a whole-run checkpoint cost next to the step it follows, on SmolLM2-135M?

    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 python benchmarks/checkpoint.py [--steps 3] [--lora]

The main job's setting: the built-in SmolLM2-135M-Instruct (GGUF, loaded as float32), the
arithmetic task, GRPO with 8 prompts x 6 samples of at most 32 tokens a step, the HF engine
sharing the trainer's model, and a reference copy (the main job's ``reference="copy"``). Each
step is followed by ``Checkpointer.save`` of everything the recipe saves (policy in the
Hugging Face format, optimizer through torch.distributed.checkpoint, data position, resharder
version, random state, history), written to a temporary folder on the same disk as the run's
(``--folder``, default the system's temporary folder), checked for non-finite weights, hashed
into its manifest (SHA-256 of every file), fsynced and renamed. The load checks the manifest
before it reads anything.

Printed side by side, per step: the step's seconds, the save's seconds and their ratio; then
the checkpoint's size on disk by part, a load's seconds (``Checkpointer.load`` into the same
blocks), and the model's own float32 bytes, for scale. The first step pays warm-ups, so the
medians are over the following ones. ``--lora`` trains a LoRA adapter (r=16) instead of every
weight: the checkpoint then holds only the adapter and its optimizer state.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import rlblocks as rb
from rlblocks.data import Difficulty, PromptBatches, arithmetic_prompts


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--folder", type=Path, default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    lora = None
    if args.lora:
        from peft import LoraConfig

        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    policy = rb.trainer.PolicyTrainer.from_pretrained(
        args.model,
        lr=3e-5,
        micro_batch_size=8,
        reference="copy" if lora is None else "auto",
        lora=lora,
    )
    engine = rb.rollout.HFEngine(policy.model, policy.tokenizer, chat=True, progress=False)
    data = arithmetic_prompts(
        n=2000,
        seed=0,
        difficulty=Difficulty(operands=2, max_operand=10, operators="+"),
        chat=True,
        instruction="Answer with just the number.",
    )
    batches = PromptBatches(data, prompts_per_step=8, seed=0)
    resharder = rb.resharder.Resharder()
    root = Path(tempfile.mkdtemp(dir=args.folder, prefix="rlblocks-ckpt-bench-"))
    ckpt = rb.checkpoint.Checkpointer(root, keep_last=1)
    blocks = {"policy": policy, "resharder": resharder, "data": batches}
    rows: list[tuple[float, float]] = []
    history: list[dict] = []

    def on_step(index: int, metrics: dict, rollouts) -> None:
        history.append(metrics)
        start = time.perf_counter()
        ckpt.save(index + 1, blocks, history=history)
        rows.append((metrics["step_seconds"], time.perf_counter() - start))
        print(
            f"step {index}: step {rows[-1][0]:6.1f} s   save {rows[-1][1]:6.2f} s   "
            f"save/step {rows[-1][1] / rows[-1][0]:.3f}",
            flush=True,
        )

    rb.recipes.grpo(
        policy,
        engine,
        rb.rewards.math_answer,
        batches,
        steps=args.steps,
        group_size=6,
        sampling=rb.SamplingParams(max_new_tokens=32),
        run=rb.run.RunOptions(
            on_step=on_step, progress=False, old_logprobs="rollout", resharder=resharder
        ),
    )
    path = root / f"step-{args.steps:08d}"
    start = time.perf_counter()
    ckpt.load(blocks)
    load_seconds = time.perf_counter() - start
    later = rows[1:] or rows
    step, save = statistics.median(r[0] for r in later), statistics.median(r[1] for r in later)
    model_bytes = sum(t.numel() * t.element_size() for t in policy.model.state_dict().values())
    print(
        f"\n{args.model} ({'LoRA r=16' if lora else 'all weights'}), float32, CPU, "
        f"{torch.get_num_threads()} threads; medians over steps 1..{args.steps - 1}"
    )
    print(f"  step           {step:8.1f} s")
    print(f"  save           {save:8.2f} s   ({save / step:.3f} of a step)")
    print(f"  load           {load_seconds:8.2f} s")
    print(
        f"  size on disk   {folder_bytes(path) / 1e6:8.1f} MB "
        f"(model state_dict: {model_bytes / 1e6:.1f} MB)"
    )
    for part in sorted(path.rglob("*")):
        if part.is_dir() and part.parent in (path, path / "policy"):
            print(f"    {part.relative_to(path)}/ {folder_bytes(part) / 1e6:10.1f} MB")
    state = sum((path / name).stat().st_size for name in ("state.json", "state.safetensors"))
    print(f"    state.*      {state / 1e6:10.3f} MB")
    shutil.rmtree(root)  # gigabytes: not left behind


if __name__ == "__main__":
    main()
