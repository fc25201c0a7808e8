"""How fast does `rb.rewards.RewardModel` score rows, batched and one by one?

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/reward_model.py --threads 1

The reward model is a built-in causal LM (``--model``, default ``smollm2-135m``) or a local
folder, loaded as ``AutoModelForSequenceClassification`` with one label: a built-in has no
trained score head, so transformers initialises one at random (a warning says so). The scores
mean nothing; the work is that of a real reward model of that size (the head is one 576 x 1
matrix product). Rows: ``--rows`` level-1 arithmetic questions (`rb.data.arithmetic_prompts`,
chat messages carried in the metadata) with made-up completions of 1 to 24 sentences, rendered
with the model's own chat template.

How it is timed: for each batch size one untimed warm-up call over all rows, then
``--repeats`` timed calls; the table reports the median, rows/s and (real, unpadded) tokens/s.
``--device cuda`` runs on a GPU (float32 unless ``--dtype bfloat16``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import rlblocks as rb


def rollouts(rows: int, seed: int) -> rb.Rollouts:
    data = rb.rewards.prompts_in_metadata(rb.data.arithmetic_prompts(rows, seed=seed, chat=True))
    rng = random.Random(seed)
    sentences = ["First I add the two numbers.", "Then I check the sum once more.", "So"]
    completions = [
        " ".join(rng.choice(sentences) for _ in range(rng.randint(1, 24))) + " #### 42"
        for _ in range(rows)
    ]
    return rb.Rollouts.from_lists(
        [[0]] * rows,
        [[0]] * rows,
        prompts=[""] * rows,
        completions=completions,
        metadata=data.metadata,
    )


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a built-in name or a folder")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = rb.models.resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=getattr(torch, args.dtype), local_files_only=True
    ).to(args.device)
    ro = rollouts(args.rows, args.seed)
    tokens = sum(len(r) for r in rb.rewards.RewardModel(model, tokenizer).encode(ro)[0])
    print(
        f"{args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
        f"{args.dtype}) on {args.device}, {torch.get_num_threads()} threads; {args.rows} rows, "
        f"{tokens / args.rows:.0f} tokens a row on average; median of {args.repeats}\n"
    )
    print(
        f"| batch_size | seconds | rows/s | tokens/s | max abs score change vs batch_size {args.batch_sizes[0]} |"
    )
    print("|---|---|---|---|---|")
    medians, reference = {}, None
    for batch_size in args.batch_sizes:
        rm = rb.rewards.RewardModel(model, tokenizer, batch_size=batch_size)
        scores = rm(ro).rewards  # warm-up
        if reference is None:
            reference = scores
        gap = float((scores - reference).abs().max())
        times = []
        for _ in range(args.repeats):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            rm(ro)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        medians[batch_size] = statistics.median(times)
        seconds = medians[batch_size]
        print(
            f"| {batch_size} | {seconds:.3f} | {args.rows / seconds:.1f} | {tokens / seconds:.0f} "
            f"| {gap:.1e} |"
        )
    return medians


if __name__ == "__main__":
    main()
