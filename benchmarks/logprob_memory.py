"""Peak memory of scoring response tokens with gradients: full logits against chunked projection.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/logprob_memory.py [--rows 16 --tokens 256]

One forward and backward of ``Σ log π(y)`` over ``--rows`` rows of a ``--prompt``-token prompt
and ``--tokens`` response tokens (random ids), on the built-in SmolLM2-135M (v = 49 152) or
``--model``, three ways:

- **full logits** (the trainer before chunked projection): ``response_logits`` materialises the
  ``(b t v)`` logits, ``token_logprobs`` scores them in chunks; the logits and their gradient
  are each ``b·t·v`` floats;
- **chunked** (``packing=False``): ``score_responses``, whose swapped head projects
  ``--chunk`` tokens at a time, forward and backward;
- **chunked + packed** (the default): the same, padding-free (rows of equal length here, so
  packing only changes the layout).

Each runs in a fresh process, so one's freed memory cannot hide another's peak. On a CPU the
peak is the process's resident high-water mark (``VmHWM``) minus its resident size just before
the forward (weights, inputs, the Python heap); on a GPU, ``torch.cuda.max_memory_allocated``
minus the memory allocated before the forward. The script prints both peaks, their ratio, and
the size of the full fp32 logits for comparison.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence

WAYS = ("full logits", "chunked", "chunked + packed")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"logprob_memory: no {field} in /proc/self/status; run it on Linux")


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One way, in this process: the peak bytes above the state before the forward."""
    import torch

    import rlblocks as rb
    from rlblocks.rollouts import Rollouts
    from rlblocks.trainer.forward import response_logits, score_responses

    torch.manual_seed(0)
    model, _ = rb.models.load(args.model, dtype=torch.float32, device=args.device)
    model.train()
    v = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, v, (args.rows, args.prompt), generator=g).tolist()
    responses = torch.randint(3, v, (args.rows, args.tokens), generator=g).tolist()
    ro = Rollouts.from_lists(prompts, responses).to(args.device)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _status("VmRSS")
    if args.way == "full logits":
        logits = response_logits(model, ro)
        lp = rb.losses.token_logprobs(logits, ro.response_ids, chunk_size=args.chunk)
    else:
        packing = args.way == "chunked + packed"
        lp, _ = score_responses(model, ro, chunk_size=args.chunk, packing=packing)
    lp.sum().backward()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status("VmHWM") - base
    return {"peak_bytes": float(peak), "vocab": float(v)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="built-in name or model folder")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--tokens", type=int, default=256, help="response tokens per row")
    p.add_argument("--chunk", type=int, default=1024, help="logprob_chunk_size")
    p.add_argument("--device", default="cpu")
    p.add_argument("--way", choices=WAYS, default=None, help="(internal) measure one way")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    if args.way is not None:
        print(json.dumps(measure(args)))
        return {}
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    peaks, vocab = {}, 0.0
    for way in WAYS:
        out = subprocess.run(
            [sys.executable, __file__, *passed, "--way", way],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        peaks[way], vocab = result["peak_bytes"], result["vocab"]
    logits = args.rows * args.tokens * vocab * 4
    print(
        f"{args.model}, {args.rows} rows x ({args.prompt} prompt + {args.tokens} response) "
        f"tokens, chunk {args.chunk}, {args.device}; full fp32 logits: {logits / 2**20:.0f} MiB"
    )
    print("| way | peak above the inputs (MiB) |\n|---|---|")
    for way in WAYS:
        print(f"| {way} | {peaks[way] / 2**20:.0f} |")
    ratio = peaks["full logits"] / max(peaks["chunked"], 1.0)
    print(f"full logits / chunked: {ratio:.2f}x")
    return {**peaks, "ratio": ratio}


if __name__ == "__main__":
    main()
