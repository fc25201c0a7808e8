"""How fast does the Resharder move weights, next to a plain memory copy of the same bytes?

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 python benchmarks/sync.py

A ``Qwen2ForCausalLM`` of about 100M parameters is built here with a random init (no download,
the tokenizer of :mod:`rlblocks.models.tiny`). Three things are timed in the same run:

- **memcpy**: ``dst.copy_(src)`` over tensors with the shapes and dtype of the model's
  ``state_dict()``: the bytes any sync must write, copied with nothing else going on. This is
  the limit: each other row is read as a fraction of its GB/s.
- **resharder**: ``Resharder(bucket_mb=...).sync(trainer, engine)`` in this process, the trainer a
  ``PolicyTrainer`` and the engine an ``HFEngine`` around a separate copy of the model (a shared
  module would copy nothing). What it adds to the memcpy: the bucketing, ``state_dict`` look-ups,
  shape checks and one ``update_weights`` call per bucket.
- **ray**: the colocated ``rb.placement.Ray(workers=...)`` path (skip with ``--no-ray``). Actor and
  rollout are built in the same workers from a saved copy of the model; a sync gathers the
  FSDP2 shards bucket by bucket through memory the workers share (each writes its rows, gloo
  carries only a barrier: ``rlblocks.trainer.shared_gather``) and each worker copies the
  buckets into its own engine. Its bytes (``sync/bytes``) are summed over workers; its seconds
  are the driver's, so they include the Ray round trip. The workers copy in parallel, so this
  ratio can pass 1. The first sync of a pool maps its shared memory (0.3-0.7 s more on the
  machine of docs/blocks/placement.md): the warm-up takes it.

How it is timed: for each sync path (and bucket size) one untimed warm-up, then ``--repeats``
rounds of one memcpy and one sync; each row reports the median sync time, and its ratio is its
GB/s over the GB/s of the memcpys paired with it, so a busy spell of the (shared) machine slows
both sides of the ratio. The ``memcpy (all runs)`` row pools every paired copy.

Decisions worth knowing: everything is float32 on the CPU (``from_pretrained`` loads float32);
bytes are those of ``state_dict()``, where tied embeddings appear under both names and are
copied twice, by the memcpy as by the engine; 1 GB = 1e9 bytes. The driver's copies are
single-threaded under ``OMP_NUM_THREADS=1``. A local sync is checked: the engine's copy starts
zeroed and must equal the trainer's afterwards, and ``sync/bytes`` must equal the memcpy's bytes.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import transformers
from torch import nn
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

import rlblocks as rb
from rlblocks.models.tiny import tiny_config, tiny_tokenizer


class Memcpy:
    """``dst.copy_(src)`` over tensors shaped like the model's ``state_dict()``: the limit."""

    def __init__(self, model: nn.Module) -> None:
        self.src = list(model.state_dict().values())
        self.dst = [torch.empty_like(t) for t in self.src]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.src)
        self.seconds: list[float] = []  # every timed copy of the run

    def __call__(self) -> float:
        start = time.perf_counter()
        for d, s in zip(self.dst, self.src, strict=True):
            d.copy_(s)
        return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: a path, the bytes one sync moves, its timed runs and the memcpy
    runs taken between them (paired, so that a busy spell of the machine slows both)."""

    label: str
    nbytes: int
    seconds: list[float]
    memcpy_bytes: int
    memcpy_seconds: list[float]

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9

    @property
    def memcpy_gb_per_s(self) -> float:
        return self.memcpy_bytes / statistics.median(self.memcpy_seconds) / 1e9


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12, help="decoder layers")
    p.add_argument("--hidden", type=int, default=768, help="hidden size")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default 8/3·hidden)")
    p.add_argument("--head-dim", type=int, default=64, help="attention head size (>= 32)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (GQA)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per path (median shown)")
    p.add_argument(
        "--bucket-mb", type=float, nargs="+", default=[64.0, 256.0], help="Resharder bucket sizes"
    )
    p.add_argument("--workers", type=int, default=2, help="Ray workers (colocated path)")
    p.add_argument("--ray", action=argparse.BooleanOptionalAction, default=True, help="Ray path")
    args = p.parse_args()
    heads, rest = divmod(args.hidden, args.head_dim)
    if args.head_dim < 32 or rest or heads % args.kv_heads:
        p.error(
            f"need head_dim >= 32 dividing hidden ({args.hidden}) into heads that kv_heads "
            f"divides; got head_dim {args.head_dim}, kv_heads {args.kv_heads}"
        )
    if args.repeats < 1 or args.workers < 1 or min(args.bucket_mb) <= 0:
        p.error("--repeats and --workers must be >= 1 and every --bucket-mb > 0")
    return args


def build_model(args: argparse.Namespace) -> tuple[nn.Module, PreTrainedTokenizerFast]:
    """A randomly initialised float32 Qwen2ForCausalLM of the requested shape, and a tokenizer."""
    tokenizer = tiny_tokenizer()
    # 8/3·hidden (the SwiGLU rule of thumb that keeps the MLP at ~8·hidden² weights), to 256s
    intermediate = args.intermediate or max(256, round(8 * args.hidden / 3 / 256) * 256)
    config = tiny_config(
        tokenizer,
        vocab_size=max(args.vocab, len(tokenizer)),
        hidden_size=args.hidden,
        intermediate_size=intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // args.head_dim,
        num_key_value_heads=args.kv_heads,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def timed(
    label: str, sync: Callable[[], dict[str, float]], memcpy: Memcpy, repeats: int
) -> tuple[Row, dict[str, float]]:
    """One warm-up of each, then ``repeats`` times a memcpy and a ``sync``; the row and the
    metrics of the last sync back. A sync's time is its own ``sync/seconds``."""
    memcpy()  # first touch of fresh pages, lazy allocations, Ray's first round trip
    sync()
    seconds, paired = [], []
    for _ in range(repeats):
        paired.append(memcpy())
        metrics = sync()
        seconds.append(metrics["sync/seconds"])
    memcpy.seconds += paired
    return Row(label, int(metrics["sync/bytes"]), seconds, memcpy.nbytes, paired), metrics


def bench_local(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    bucket_mb: float,
    memcpy: Memcpy,
    repeats: int,
) -> Row:
    """``Resharder.sync`` between a trainer and an engine holding its own copy of the model."""
    trainer = rb.trainer.PolicyTrainer(model, reference=None)
    engine_model = copy.deepcopy(model)
    with torch.no_grad():  # so that a sync that copies nothing cannot pass the check below
        for p in engine_model.parameters():
            p.zero_()
    engine = rb.rollout.HFEngine(engine_model, tokenizer, progress=False)
    resharder = rb.resharder.Resharder(bucket_mb=bucket_mb)
    row, metrics = timed("resharder", lambda: resharder.sync(trainer, engine), memcpy, repeats)
    synced = engine_model.state_dict()
    for name, value in model.state_dict().items():
        if not torch.equal(synced[name], value):
            raise RuntimeError(f"after a sync the engine's {name!r} differs from the trainer's")
    if row.nbytes != memcpy.nbytes:
        raise RuntimeError(f"a sync moved {row.nbytes} bytes, the state dict has {memcpy.nbytes}")
    label = f"resharder {bucket_mb:g} MB ({metrics['sync/buckets']:.0f} buckets)"
    return dataclasses.replace(row, label=label)


def bench_ray(
    model: nn.Module, tokenizer: PreTrainedTokenizerFast, memcpy: Memcpy, args: argparse.Namespace
) -> list[Row]:
    """The colocated Ray path: FSDP2 all-gather, then a copy into each worker's engine."""
    rows = []
    quiet = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # no "Loading weights" bars from the workers
    placement = rb.placement.Ray(workers=args.workers, env=quiet)
    with tempfile.TemporaryDirectory() as folder, placement:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        load_trainer = rb.trainer.PolicyTrainer.from_pretrained
        trainer = placement.build("actor", load_trainer, folder, reference=None)
        engine = placement.build(
            "rollout", rb.rollout.HFEngine.from_pretrained, folder, progress=False
        )
        for bucket_mb in args.bucket_mb:
            resharder = rb.resharder.Resharder(bucket_mb=bucket_mb)
            label = f"ray {args.workers} workers, {bucket_mb:g} MB"
            sync = functools.partial(resharder.sync, trainer, engine)
            rows.append(timed(label, sync, memcpy, args.repeats)[0])
    return rows


def print_table(rows: list[Row]) -> None:
    head = f"{'path':<36} {'bytes':>13} {'s (median)':>11} {'s (min)':>9} {'GB/s':>7}"
    print(f"{head} {'memcpy GB/s':>12} {'ratio':>6}")
    for row in rows:
        print(
            f"{row.label:<36} {row.nbytes:>13,} {statistics.median(row.seconds):>11.4f} "
            f"{min(row.seconds):>9.4f} {row.gb_per_s:>7.2f} {row.memcpy_gb_per_s:>12.2f} "
            f"{row.gb_per_s / row.memcpy_gb_per_s:>6.2f}"
        )


def main() -> None:
    args = parse_args()
    transformers.utils.logging.disable_progress_bar()
    model, tokenizer = build_model(args)
    memcpy = Memcpy(model)
    c = model.config
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    print(
        f"Qwen2ForCausalLM: {params:,} parameters ({c.num_hidden_layers} layers, hidden "
        f"{c.hidden_size}, MLP {c.intermediate_size}, {c.num_attention_heads} heads of "
        f"{c.hidden_size // c.num_attention_heads}, {c.num_key_value_heads} kv heads, vocab "
        f"{c.vocab_size}), float32; state_dict {memcpy.nbytes:,} bytes; "
        f"median of {args.repeats} runs after 1 warm-up; torch threads {torch.get_num_threads()}"
    )
    rows = [bench_local(model, tokenizer, mb, memcpy, args.repeats) for mb in args.bucket_mb]
    if args.ray:
        rows += bench_ray(model, tokenizer, memcpy, args)
    # the limit: every memcpy of the run (each row's ratio uses only the copies paired with it)
    limit = Row("memcpy (all runs)", memcpy.nbytes, memcpy.seconds, memcpy.nbytes, memcpy.seconds)
    print_table([limit, *rows])


if __name__ == "__main__":
    main()
