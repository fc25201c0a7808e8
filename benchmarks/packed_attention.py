"""One micro-batch's forward and backward, packed or padded: where a packed update's time goes.

    python benchmarks/packed_attention.py                                   # tiny shape, CPU
    python benchmarks/packed_attention.py --model qwen2-0.5b-random --dtype bf16 --device cuda \\
        --rows 32 --repeats 5 --profile --out runs/packed-attention

Times ``score_responses`` (the trainer's scoring forward: log-probs of the response tokens,
chunked over the vocabulary) and the backward of their sum on one micro-batch of ``--rows`` rows,
in three ways side by side: ``padded`` (``packing=False``: the right-padded ``(b s)`` batch),
``packed-rows`` (packing, the row attention as one ``scaled_dot_product_attention`` call per
row and layer) and ``packed-batched`` (packing, the rows right-padded inside the attention
only, one call per layer: ``rlblocks.models.packing.attend_rows``), and on a GPU in bf16
``packed-varlen`` (torch's variable-length flash kernel, no padding: ``rlblocks.models.varlen``;
the trainer's default there). It prints the median
seconds of each after one warm-up and the ratios, checks that the three give the same
log-probs to the dtype's rounding, and with ``--profile`` the top operators of one
``packed-rows`` and one ``packed-batched`` pass by self time.

The rows have GRPO-like lengths: prompts of 50 to 102 tokens, responses geometric with
P(end) = 1/64 per token, at most ``--max-new-tokens`` (the GPU check's shapes, docs/gpu.md),
drawn with ``--seed``. The model is random-init from its config (no download, no file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from grpo_step import RANDOM_MODELS  # beside this script: its directory leads sys.path
from transformers import Qwen2ForCausalLM

import rlblocks as rb
from rlblocks.models import packing as packing_module
from rlblocks.trainer.forward import score_responses

WAYS = ("padded", "packed-rows", "packed-batched")
VARLEN_WAY = "packed-varlen"
"""On a GPU in bf16, where torch has the variable-length flash kernel (rlblocks.models.varlen):
the packed rows with no padding at all."""


def ways_for(device: str, dtype: torch.dtype) -> tuple[str, ...]:
    """The ways this run times: :data:`WAYS`, and :data:`VARLEN_WAY` where it can run."""
    from rlblocks.models import varlen

    probe = torch.zeros(1, dtype=dtype, device=device)
    return WAYS + ((VARLEN_WAY,) if varlen.serves(probe) else ())


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model", default="tiny", choices=sorted(RANDOM_MODELS))
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=8, help="rows of the micro-batch")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed passes of each way")
    p.add_argument("--chunk-size", type=int, default=1024, help="tokens per vocabulary chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="top operators of the packed ways")
    p.add_argument("--out", type=Path, help="write results.json and results.md there")
    args = p.parse_args(argv)
    if args.rows < 1 or args.repeats < 1:
        p.error("--rows and --repeats must be at least 1")
    return args


def rollouts(args: argparse.Namespace, vocab: int) -> rb.Rollouts:
    """``--rows`` rows of random ids with GRPO-like lengths (module docstring)."""
    g = torch.Generator().manual_seed(args.seed)
    prompts, responses = [], []
    for _ in range(args.rows):
        n_prompt = int(torch.randint(50, 103, (), generator=g))
        ends = torch.rand(args.max_new_tokens, generator=g) < 1 / 64
        n_response = int(ends.nonzero()[0]) + 1 if ends.any() else args.max_new_tokens
        prompts.append(torch.randint(3, vocab, (n_prompt,), generator=g).tolist())
        responses.append(torch.randint(3, vocab, (n_response,), generator=g).tolist())
    return rb.Rollouts.from_lists(prompts, responses, pad_token_id=0).to(args.device)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_pass(model: torch.nn.Module, ro: rb.Rollouts, way: str, chunk_size: int) -> torch.Tensor:
    """Forward and backward of ``way``; returns the log-probs (detached)."""
    packing_module.BATCHED = way == "packed-batched"
    packing_module.VARLEN = way == "packed-varlen"
    try:
        lp, _ = score_responses(model, ro, chunk_size=chunk_size, packing=way != "padded")
        lp.float().sum().backward()
    finally:
        packing_module.BATCHED = packing_module.VARLEN = None
    model.zero_grad(set_to_none=True)
    return lp.detach()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = rb.models.tiny_tokenizer()
    config = rb.models.tiny_config(tokenizer, **RANDOM_MODELS[args.model])
    config._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = Qwen2ForCausalLM(config).to(DTYPES[args.dtype])
    model.train()
    ro = rollouts(args, config.vocab_size)
    lengths = ro.attention_mask.sum(-1)
    real, grid = int(lengths.sum()), ro.attention_mask.numel()
    title = (
        f"{args.model}, {args.dtype}, {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
        + f"; {args.rows} rows of {int(lengths.min())}-{int(lengths.max())} tokens "
        f"({real} real, {grid} padded); torch {torch.__version__}"
    )
    print(title, flush=True)
    seconds: dict[str, list[float]] = {}
    scores: dict[str, torch.Tensor] = {}
    ways = ways_for(args.device, DTYPES[args.dtype])
    for way in ways:
        scores[way] = one_pass(model, ro, way, args.chunk_size)  # warm-up
        seconds[way] = []
        for _ in range(args.repeats):
            sync(args.device)
            start = time.perf_counter()
            one_pass(model, ro, way, args.chunk_size)
            sync(args.device)
            seconds[way].append(time.perf_counter() - start)
        print(f"  {way:15s} {statistics.median(seconds[way]):8.3f} s", flush=True)
    mask = ro.response_attention_mask.bool()
    gaps = {
        way: float((scores[way].float() - scores["padded"].float())[mask].abs().max())
        for way in ways[1:]
    }
    medians = {way: statistics.median(s) for way, s in seconds.items()}
    ratios = {
        "packed-rows / padded": medians["packed-rows"] / medians["padded"],
        "packed-batched / padded": medians["packed-batched"] / medians["padded"],
        "packed-rows / packed-batched": medians["packed-rows"] / medians["packed-batched"],
    }
    if VARLEN_WAY in medians:
        ratios["packed-varlen / packed-batched"] = medians[VARLEN_WAY] / medians["packed-batched"]
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    for way, gap in gaps.items():
        print(f"max |log-prob({way}) - log-prob(padded)|: {gap:.3g}")
    profiles = {}
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        sort = "self_cpu_time_total"
        if args.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            sort = "self_cuda_time_total"
        for way in ways[1:]:
            with torch.profiler.profile(activities=activities) as prof:
                one_pass(model, ro, way, args.chunk_size)
                sync(args.device)
            profiles[way] = prof.key_averages().table(sort_by=sort, row_limit=15)
            print(f"\n{way}, top operators by {sort}:\n{profiles[way]}", flush=True)
    result = {
        "title": title,
        "argv": sys.argv[1:] if argv is None else argv,
        "seconds": seconds,
        "median_seconds": medians,
        "ratios": ratios,
        "max_logprob_gap": gaps,
        "profiles": profiles,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "packed_attention.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
