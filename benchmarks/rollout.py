"""How fast does each rollout engine sample, side by side, and how far from the machine is it?

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/rollout.py            # the CPU table
    python benchmarks/rollout.py --prompts 4 --n 4 --max-new-tokens 64         # 16 rows
    python benchmarks/rollout.py --model qwen2-0.5b-random --dtype bfloat16 --device cuda \\
        --prompts 64 --n 4 --max-new-tokens 256 --responses eos --out runs/rollout   # a GPU

Every engine loads the same model (default the built-in ``"smollm2-135m"``;
``qwen2-0.5b-random`` / ``smollm2-135m-random`` / ``tiny`` are random weights of that shape,
built by ``benchmarks/grpo_step.py``'s builder, with an EOS hazard when responses end at EOS)
in ``--dtype`` on ``--device``, and answers the same chat prompts
(``rb.data.arithmetic_prompts``, the main job's instruction) ``--n`` times each with the same
``SamplingParams`` (temperature 1, no top-k / top-p, a fixed seed). The engines (``--engines``):

- **hf**: ``rb.rollout.HFEngine``: padded ``model.generate``, one batch of every row.
- **static**: ``rb.rollout.CompiledEngine(compile=False)``: the static cache, one prefill per
  prompt, rows that end compacted out, the step run eagerly (the engine's default off CUDA).
- **compiled**: ``rb.rollout.CompiledEngine(compile=True)``: the same step compiled whole
  (CUDA graphs on a GPU, the engine's default there).
- **cb**: ``rb.rollout.ContinuousBatchingEngine``: transformers' continuous batching.
- **vllm**: ``rb.rollout.VLLMEngine``, where vLLM is installed (skipped otherwise).

Two response modes (``--responses``, default both): **fixed**, every response exactly
``--max-new-tokens`` long (EOS held back with ``min_new_tokens``: equal work for every engine;
continuous batching cannot hold EOS back and is skipped there), and **eos**, responses that end
where the model ends them (mixed lengths: an engine that keeps computing ended rows pays).

Timing: the engine is built (timed), one untimed ``generate`` warms it up (its time is printed:
compilation happens there), then ``--repeats`` timed ones; tok/s is the median of each run's
sampled tokens (``response_mask.sum()``, EOS counted) over its seconds. ``ops/step``: aten
operators dispatched from Python per decoding step (a ``TorchDispatchMode`` over one extra
``generate``, divided by its longest response, prefill included): what a GPU pays a kernel
launch for each. The compiled engine's step is one graph (a compiled graph cannot run under a
dispatch mode; ``tests/rollout/test_compiled.py`` holds it to one graph with
``fullgraph=True``), replayed on a GPU as one CUDA graph launch. ``of bound``: the
fraction of the memory-bandwidth bound reached: decoding reads every weight once per step, so
the fastest a run of s steps can be is s · weight bytes / bandwidth, the bandwidth measured in
the same run (a copy of a 256 MiB (CPU) or 2 GiB (GPU) tensor). On a 2-core CPU at these
sizes decoding is bound by arithmetic, not bandwidth, so this fraction is small there; on a GPU
it says how far the decode is from the chip.

The machine may be shared: compare ``s (min)`` too, and rerun when two engines disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import rlblocks as rb
from rlblocks.interfaces import Prompt, RolloutEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from grpo_step import RANDOM_MODELS, build_random_model, eos_hazard, print_profile, sync

INSTRUCTION = "Answer with just the number."  # the main job's (examples/grpo_arithmetic.yaml)
ENGINES = ("hf", "static", "compiled", "cb", "vllm")


class Skipped(Exception):
    """An engine that cannot run this setting here: the reason."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: an engine in one response mode."""

    engine: str
    responses: str
    build_s: float
    warmup_s: float
    seconds: list[float]
    tokens: list[int]
    steps: int  # decoding steps of the last timed run: its longest response
    rows: int
    mean_length: float
    ops_per_step: float | None

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(t / s for t, s in zip(self.tokens, self.seconds, strict=True))


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m",
                   help=f"built-in name, folder, or one of {sorted(RANDOM_MODELS)}")  # fmt: skip
    p.add_argument("--dtype", default="float32", help="weights' torch dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=8, help="arithmetic chat prompts")
    p.add_argument("--n", type=int, default=6, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32, help="longest response")
    p.add_argument("--responses", choices=["fixed", "eos", "both"], default="both")
    p.add_argument("--eos-hazard", type=float, default=None,
                   help="random models: P(EOS) per position (default 4 / max-new-tokens)")  # fmt: skip
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=None,
                   help="default: hf static compiled cb vllm (compiled left out on a CPU: "
                        "a minute of inductor at its first call, not won back there, docs/speed.md)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median shown)")
    cores = len(os.sched_getaffinity(0))
    p.add_argument("--threads", type=int, default=cores, help=f"CPU threads (default {cores})")
    p.add_argument("--out", type=Path, default=None, help="write rollout.json / rollout.md here")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N aten operators one generate spends most time in")  # fmt: skip
    args = p.parse_args(argv)
    if min(args.prompts, args.n, args.max_new_tokens, args.repeats, args.threads) < 1:
        p.error("--prompts, --n, --max-new-tokens, --repeats and --threads must be >= 1")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        p.error(f"--dtype {args.dtype!r} is not a torch dtype (float32, bfloat16, ...)")
    if args.engines is None:
        cpu = torch.device(args.device).type == "cpu"
        args.engines = [e for e in ENGINES if not (cpu and e == "compiled")]
    return args


def bandwidth(device: str) -> float:
    """Bytes per second of a large copy (read + write), the best of 5."""
    size = (2 << 30) if torch.device(device).type == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * size / best


def build_engine(name: str, path: str, args: argparse.Namespace) -> RolloutEngine:
    dtype = getattr(torch, args.dtype)
    common = {"dtype": dtype, "device": args.device, "progress": False, "chat": True}
    if name == "hf":
        return rb.rollout.HFEngine.from_pretrained(path, **common)
    if name in ("static", "compiled"):
        return rb.rollout.CompiledEngine.from_pretrained(path, compile=name == "compiled",
                                                         **common)  # fmt: skip
    if name == "cb":
        return rb.rollout.ContinuousBatchingEngine.from_pretrained(path, **common)
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise Skipped(f"vLLM is not installed ({error})") from None
    return rb.rollout.VLLMEngine(path, dtype=args.dtype)


def measure(name: str, path: str, prompts: list[Prompt], responses: str,
            args: argparse.Namespace) -> Row:  # fmt: skip
    fixed = responses == "fixed"
    if fixed and name == "cb":
        raise Skipped("continuous batching cannot hold EOS back (min_new_tokens)")
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed,
                              min_new_tokens=args.max_new_tokens if fixed else 0)  # fmt: skip
    start = time.perf_counter()
    engine = build_engine(name, path, args)
    build_s = time.perf_counter() - start
    run = functools.partial(engine.generate, prompts, group_size=args.n, sampling=sampling)
    start = time.perf_counter()
    run()
    warmup_s = time.perf_counter() - start
    seconds, tokens = [], []
    for _ in range(args.repeats):
        sync(args.device)
        start = time.perf_counter()
        rollouts = run()
        sync(args.device)
        seconds.append(time.perf_counter() - start)
        tokens.append(int(rollouts.response_mask.sum()))
    lengths = rollouts.response_mask.sum(-1)
    ops = None
    # vLLM's work is not dispatched through this process's torch ops; a compiled graph cannot
    # run under a dispatch mode (its step is one graph: the table says so)
    if name not in ("vllm", "compiled"):
        counter = OpCounter()
        with counter:
            counted = run()
        ops = counter.count / max(1, int(counted.response_mask.sum(-1).max()))
    if args.profile:
        heading = (
            f"profile of {name} ({responses}), one generate of {{wall:.2f}} s under the profiler:"
        )
        print_profile(heading, run, args.profile)
    row = Row(name, responses, build_s, warmup_s, seconds, tokens, int(lengths.max()),
              len(lengths), lengths.float().mean().item(), ops)  # fmt: skip
    del engine, rollouts
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return row


def weight_bytes(path: str, args: argparse.Namespace) -> int:
    """Bytes of the weights one decoding step reads (a tied head counted once)."""
    config = transformers.AutoConfig.from_pretrained(rb.models.loading.resolve(path))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    unique = {id(p): p.numel() for p in model.parameters()}
    return sum(unique.values()) * getattr(torch, args.dtype).itemsize


def table(rows: list[Row], reference: dict[str, Row], bound_s: float) -> list[str]:
    """Markdown lines; ``bound_s``: seconds per decoding step at the bandwidth bound."""
    head = ("engine", "responses", "build s", "warm-up s", "s (median)", "s (min)", "tokens",
            "mean len", "tok/s", "/ hf", "ops/step", "of bound")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ref = reference.get(r.responses)
        ratio = f"{r.tokens_per_s / ref.tokens_per_s:.2f}" if ref else "—"
        bound = r.steps * bound_s / statistics.median(r.seconds)
        ops = {"compiled": "1 graph", "vllm": "—"}.get(r.engine, f"{r.ops_per_step or 0:.0f}")
        cells = (r.engine, r.responses, f"{r.build_s:.1f}", f"{r.warmup_s:.1f}",
                 f"{statistics.median(r.seconds):.3f}", f"{min(r.seconds):.3f}",
                 f"{statistics.median(r.tokens):.0f}", f"{r.mean_length:.1f}",
                 f"{r.tokens_per_s:.1f}", ratio, ops, f"{100 * bound:.2f}%")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def model_path(args: argparse.Namespace, folder: Path) -> str:
    if args.model not in RANDOM_MODELS:
        return args.model
    eos = args.responses in ("eos", "both")
    hazard = eos_hazard(args) if eos else None
    return build_random_model(args.model, folder, seed=args.seed, dtype=getattr(torch, args.dtype),
                              device=args.device, hazard=hazard)  # fmt: skip


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    prompts = rb.data.arithmetic_prompts(n=args.prompts, chat=True, instruction=INSTRUCTION).prompts
    modes = ["fixed", "eos"] if args.responses == "both" else [args.responses]
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as folder:
        path = model_path(args, Path(folder))
        per_second = bandwidth(args.device)
        bound_s = weight_bytes(path, args) / per_second
        print(
            f"model {args.model!r}, {args.dtype} on {args.device}; {args.prompts} prompts x "
            f"{args.n} samples, max_new_tokens {args.max_new_tokens}, temperature 1, seed "
            f"{args.seed}; {args.threads} threads; median of {args.repeats} runs after 1 "
            f"warm-up; bandwidth {per_second / 1e9:.1f} GB/s, a step's weights "
            f"{bound_s * per_second / 1e6:.0f} MB = {bound_s * 1e3:.3f} ms at that bandwidth; "
            f"torch {torch.__version__}, transformers {transformers.__version__}",
            flush=True,
        )
        for mode in modes:
            for name in args.engines:
                try:
                    rows.append(measure(name, path, prompts, mode, args))
                    print(f"  {name} ({mode}): {rows[-1].tokens_per_s:.1f} tok/s", flush=True)
                except Skipped as reason:
                    skipped[f"{name} ({mode})"] = str(reason)
    reference = {r.responses: r for r in rows if r.engine == "hf"}
    lines = table(rows, reference, bound_s)
    lines += [f"skipped {k}: {v}" for k, v in skipped.items()]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rollout.md").write_text("\n".join(lines) + "\n")
        record = {"setup": vars(args) | {"out": str(args.out), "bandwidth": per_second,
                                          "bound_s_per_step": bound_s},
                  "rows": [dataclasses.asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rows],
                  "skipped": skipped}  # fmt: skip
        (args.out / "rollout.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    return rows


if __name__ == "__main__":
    main()
