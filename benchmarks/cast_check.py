"""What the overflow check of a narrowing sync costs (`rlblocks.rollout.casting.check_cast`).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/cast_check.py [--hidden 512]

A float32 ``PolicyTrainer`` around the tiny model (``--hidden 0``) or a 4-layer one of width
``--hidden`` (random init, no download), and an `HFEngine` around a float16 copy of it: the
engine's ``update_weights`` of the whole ``state_dict`` is timed with the check and with it
replaced by a no-op, and the check is timed alone. Each figure is the median of ``--repeats``
calls after 20 untimed ones (``torch.cuda.synchronize`` around each on ``--device cuda``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

import rlblocks as rb
from rlblocks.models import tiny
from rlblocks.rollout import hf
from rlblocks.rollout.casting import check_cast


def median_ms(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median wall milliseconds of ``fn()`` over ``repeats`` calls."""
    seconds = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=0, help="0: the tiny model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    sizes = {"hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8}  # fmt: skip
    model, tokenizer = tiny(seed=0, **(sizes if args.hidden else {}))
    model = model.to(args.device)
    engine = rb.rollout.HFEngine(copy.deepcopy(model).half(), tokenizer, progress=False)
    weights = list(model.state_dict().items())
    dtypes = dict.fromkeys(dict(weights), torch.float16)
    for _ in range(20):
        engine.update_weights(weights, version=0)
    checked = median_ms(
        lambda: engine.update_weights(weights, version=0), args.repeats, args.device
    )
    alone = median_ms(lambda: check_cast(weights, dtypes, owner="bench"), args.repeats, args.device)
    real, hf.check_cast = hf.check_cast, lambda *a, **k: None
    try:
        unchecked = median_ms(
            lambda: engine.update_weights(weights, version=0), args.repeats, args.device
        )
    finally:
        hf.check_cast = real
    count = sum(t.numel() for _, t in weights) / 1e6
    print(f"{args.device}, {count:.2f} M weights in {len(weights)} tensors, float32 -> float16: "
          f"update_weights {checked:.2f} ms with the check, {unchecked:.2f} ms without; the "
          f"check alone {alone:.2f} ms")  # fmt: skip
    return {"checked_ms": checked, "unchecked_ms": unchecked, "check_ms": alone}


if __name__ == "__main__":
    main()
