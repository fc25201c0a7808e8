"""Tokens per second of ``ContinuousBatchingEngine`` next to ``HFEngine``, at a few concurrencies.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/rollout_cb.py [--model tiny]
        [--concurrency 8 32] [--prompts 32] [--max-new-tokens 64] [--device cuda]

Both engines sample with the same module (default the built-in ``"smollm2-135m"``; ``--model
tiny`` for a quick check) in ``--dtype`` on ``--device``, from the same chat prompts
(``rb.data.arithmetic_prompts``, ``--n`` samples each), with temperature 1 and a fixed seed. At
each concurrency c: **hf** is ``HFEngine(max_batch_size=c)`` (padded ``model.generate`` on c
rows at a time, each batch running until its longest row ends), **cb** is
``ContinuousBatchingEngine(max_concurrent=c)`` (at most c sequences in flight; an ended one's
place goes to the next row at once).

Timing: one untimed ``generate`` per engine and concurrency, then ``--repeats`` timed ones;
tokens are the sampled ones (``response_mask.sum()``, EOS counted, padding not); tok/s is the
median of each run's tokens / seconds. The two engines draw from different random streams, so
their responses differ: ``mean len`` and ``at max`` say how long they were. The machine may be
shared: compare ``s (min)`` too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import transformers

import rlblocks as rb
from rlblocks.interfaces import SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="built-in name or model folder")
    p.add_argument("--dtype", default="float32", help="weights' torch dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=32, help="arithmetic chat prompts")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest response")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32], help="rows at once")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (median shown)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--threads", type=int, default=cores, help=f"CPU threads (default {cores})")
    args = p.parse_args()
    if min(args.prompts, args.n, args.max_new_tokens, args.repeats, *args.concurrency) < 1:
        p.error("--prompts, --n, --max-new-tokens, --repeats and --concurrency must be >= 1")
    return args


def measure(engine, prompts, args) -> dict[str, float]:
    """One untimed ``generate``, then ``args.repeats`` timed ones; the table's numbers."""
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed)
    seconds, tokens = [], []
    for run in range(args.repeats + 1):
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        ro = engine.generate(prompts, group_size=args.n, sampling=sampling)
        if run > 0:
            seconds.append(time.perf_counter() - start)
            tokens.append(int(ro.response_mask.sum()))
    lengths = ro.response_mask.sum(-1)
    return {
        "rows": len(lengths),
        "tokens": statistics.median(tokens),
        "mean_len": lengths.float().mean().item(),
        "at_max": int((lengths == args.max_new_tokens).sum()),
        "s_median": statistics.median(seconds),
        "s_min": min(seconds),
        "tok_s": statistics.median(t / s for t, s in zip(tokens, seconds, strict=True)),
    }


def main() -> None:
    args = parse_args()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model, tokenizer = rb.models.load(
        args.model, dtype=getattr(torch, args.dtype), device=args.device
    )
    prompts = rb.data.arithmetic_prompts(n=args.prompts, chat=True).prompts
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"model {args.model!r}, {args.dtype} on {name}, torch threads {torch.get_num_threads()}; "
        f"{args.prompts} prompts x {args.n} samples, max_new_tokens {args.max_new_tokens}, "
        f"temperature 1, seed {args.seed}; median of {args.repeats} runs after 1 warm-up"
    )
    print(
        f"{'engine':<6} {'conc':>5} {'rows':>5} {'tokens':>7} {'mean len':>9} {'at max':>7} "
        f"{'s (median)':>11} {'s (min)':>8} {'tok/s':>8} {'cb/hf':>6}"
    )
    for c in args.concurrency:
        hf = rb.rollout.HFEngine(model, tokenizer, max_batch_size=c, progress=False)
        cb = rb.rollout.ContinuousBatchingEngine(model, tokenizer, max_concurrent=c, progress=False)
        results = {"hf": measure(hf, prompts, args), "cb": measure(cb, prompts, args)}
        for label, r in results.items():
            ratio = r["tok_s"] / results["hf"]["tok_s"]
            print(
                f"{label:<6} {c:>5} {r['rows']:>5} {r['tokens']:>7.0f} {r['mean_len']:>9.1f} "
                f"{r['at_max']:>7} {r['s_median']:>11.3f} {r['s_min']:>8.3f} "
                f"{r['tok_s']:>8.1f} {ratio:>6.2f}"
            )


if __name__ == "__main__":
    main()
