"""Per-rank memory of one training micro-batch under each parallel layout, side by side.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/mesh_memory.py [--quick] [--out DIR]

The same random-init Qwen2 (:data:`MODEL`: hidden 512, 8 heads, 8 key-value heads, 4 layers,
MLP 1408, vocabulary 32 000, tied embeddings, float32; about 29 M parameters) is trained on the
same batch (2 rows of 1024 tokens: 64 prompt + 960 response, random ids, packed as the trainer
does by default) under each layout of :data:`LAYOUTS`: one process, DP2 (FSDP2 over two
ranks), TP2 (tensor parallel over two ranks), DP2×TP2 (four ranks), SP2 (sequence parallel,
once ``TrainConfig`` has ``sp``; until then the row says "not built yet").

Each rank is a fresh process (gloo over a ``file://`` rendezvous, one thread, seed 0) that
builds the trainer (``PolicyTrainer(model, reference=None, tp=...)``, ``shard()`` when it has
peers), runs a short warm-up ``forward_backward`` (2 rows of 8 tokens: packing's isolation
check, gloo's buffers and the gradients are allocated there), one more to count its
collectives, then the measured ``forward_backward`` on the long batch as one micro-batch,
then ``optim_step``. It reports, of its own LOCAL shards (``DTensor.to_local()``):

- **params**, **grads** (after the measured pass), **optimizer** (AdamW's two moments and its
  step counters, after ``optim_step``), and **whole**: the parameter bytes it holds unsplit
  (the same on every rank of its group: norms under TP);
- **saved**: the bytes autograd holds for backward at the end of the measured forward, each
  storage counted once, parameters (and views of them, FSDP2's gathered ones included)
  left out (:class:`SavedForBackward`). Deterministic: the activation memory a layout keeps
  per rank;
- **rss**: the process's resident high-water mark over the measured pass (``VmHWM`` reset just
  before it through ``/proc/self/clear_refs``) minus its resident size then. It adds the
  transient buffers (attention, logit chunks, gathered weights not already held from the
  warm-up) to the saved activations, and depends on the allocator: a secondary measure;
- **tokens**: the tokens its embedding layer saw in the measured pass;
- **collectives**: the collectives of the second short ``forward_backward`` (counted apart,
  so that the counting touches no measured number), by kind: all-reduce, all-gather,
  reduce-scatter, all-to-all (:func:`collectives`). Their number depends on the layers and
  the layout, not on the tokens.

The table prints the largest value over a layout's ranks, with ratios to the one-process row.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: The model's shape (``rb.models.tiny`` overrides of its Qwen2 config): realistic proportions,
#: CPU-sized. Every size divides by 2 (heads, key-value heads, MLP features, vocabulary).
MODEL: dict[str, int] = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "num_hidden_layers": 4,
    "intermediate_size": 1408,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
#: ``--quick``: the tiny test model with two key-value heads (so that tp = 2 applies).
QUICK_MODEL: dict[str, int] = {"num_key_value_heads": 2}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model and the measured batch: ``rows`` rows of ``prompt`` + ``response`` tokens."""

    model: dict[str, int]
    rows: int
    prompt: int
    response: int


FULL = Shape(MODEL, rows=2, prompt=64, response=960)
QUICK = Shape(QUICK_MODEL, rows=2, prompt=8, response=56)
WARM_UP = (4, 4)  # prompt, response tokens of the warm-up rows


@dataclasses.dataclass(frozen=True)
class Layout:
    """One row of the table: ``world`` processes, each a trainer with ``options`` (fields of
    ``TrainConfig``)."""

    name: str
    world: int
    options: dict[str, int]


LAYOUTS: tuple[Layout, ...] = (
    Layout("one process", 1, {}),
    Layout("DP2", 2, {}),
    Layout("TP2", 2, {"tp": 2}),
    Layout("DP2xTP2", 4, {"tp": 2}),
    Layout("SP2", 2, {"sp": 2}),
)
COLUMNS = ("params", "grads", "optimizer", "whole", "saved", "rss", "tokens")


# ---------------------------------------------------------------------- one rank
class SavedForBackward:
    """Bytes of the tensors autograd saves for backward while active, each storage once.

    A ``torch.autograd.graph.saved_tensors_hooks`` pack hook sees every tensor a forward saves;
    a DTensor is counted by its local tensor. Tensors whose storage is a parameter's (a weight,
    its transpose, FSDP2's all-gathered copy registered on the module during its forward) are
    weight-side, not activations, and are left out. Every counted storage stays alive until
    the backward, so no address is reused within one forward.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.storages: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, tensor: Any) -> Any:
        for inner in _plain(tensor):
            storage = inner.untyped_storage()
            address = storage.data_ptr()
            if storage.nbytes() and address not in self.storages and address not in self._weights():
                self.storages[address] = storage.nbytes()
        return tensor

    def _weights(self) -> set[int]:
        return {s.untyped_storage().data_ptr() for p in self.model.parameters() for s in _plain(p)}

    def hooks(self) -> Any:
        """The context in which forwards are counted (``saved_tensors_hooks``)."""
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)


def _local(tensor: Any) -> Any:
    """The local shard of a DTensor (no autograd edge), a plain tensor as it is."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def _plain(tensor: Any) -> list[Any]:
    """The plain tensors that hold ``tensor``'s data: itself, or the inner tensors of a wrapper
    subclass (a DTensor's local shard, a collective's pending result), recursively."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    import torch

    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]  # a DTensor's names its mesh too
    return [leaf for x in inner if isinstance(x, torch.Tensor) for leaf in _plain(x)]


def _nbytes(tensor: Any) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"mesh_memory: no {field} in /proc/self/status; run it on Linux")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the kernel's reset of VmHWM to the current resident size


def batch(shape: Shape, prompt: int, response: int, vocab: int) -> tuple[Any, Any]:
    """``shape.rows`` rows of random ids (seed 0) and one advantage per row."""
    import torch

    from rlblocks.rollouts import Rollouts

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (shape.rows, prompt), generator=g).tolist()
    responses = torch.randint(3, vocab, (shape.rows, response), generator=g).tolist()
    return Rollouts.from_lists(prompts, responses), torch.randn(shape.rows, generator=g)


def measure(layout: Layout, shape: Shape, **options: int) -> dict[str, int]:
    """This rank's bytes (module docstring), in a process group of ``layout.world`` when it
    has peers (initialised by the caller); ``options``: more ``TrainConfig`` fields."""
    from functools import partial

    import torch

    import rlblocks as rb

    torch.manual_seed(0)
    model, _ = rb.models.tiny(seed=0, dtype=torch.float32, **shape.model)
    options = {**layout.options, **options}
    trainer = rb.trainer.PolicyTrainer(model, reference=None, lr=1e-4, **options)
    if layout.world > 1:
        trainer.shard()
    loss = partial(rb.losses.clipped_surrogate, clip=(0.2, 0.2))
    vocab = model.config.vocab_size
    short = batch(shape, *WARM_UP, vocab)
    trainer.forward_backward(*short, loss_fn=loss)  # first calls: one-time checks, buffers
    with collectives() as counted:  # the collectives of a pass, apart from the one measured
        trainer.forward_backward(*short, loss_fn=loss)
    ro, advantages = batch(shape, shape.prompt, shape.response, vocab)
    tokens = []
    embedding = trainer.model.get_input_embeddings()
    counting = embedding.register_forward_pre_hook(lambda m, args: tokens.append(args[0].numel()))
    base = _status("VmRSS")
    _reset_peak_rss()
    saved = SavedForBackward(trainer.model)
    with saved.hooks():
        trainer.forward_backward(ro, advantages, loss_fn=loss)
    rss = _status("VmHWM") - base
    counting.remove()
    params = list(trainer.model.parameters())
    grads = sum(_nbytes(p.grad) for p in params if p.grad is not None)
    trainer.optim_step()
    state = trainer.optimizer.state.values()
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": grads,
        "optimizer": sum(_nbytes(v) for s in state for v in s.values() if torch.is_tensor(v)),
        "whole": sum(_nbytes(p) for p in params if _local(p).shape == p.shape),
        "saved": saved.nbytes,
        "rss": rss,
        "tokens": sum(tokens),
        **{f"collectives/{kind}": n for kind, n in counted.items()},
    }


#: Collective ops (c10d and functional-collective op names) by the kind they are counted as.
KINDS = {
    "all-reduce": ("allreduce", "all_reduce"),
    "all-gather": ("allgather", "all_gather"),
    "reduce-scatter": ("reduce_scatter",),
    "all-to-all": ("alltoall", "all_to_all"),
    "broadcast": ("broadcast",),
}


@contextlib.contextmanager
def collectives() -> Iterator[Counter]:
    """Count the collectives launched inside (kind -> calls), DTensor's functional collectives
    and FSDP2's c10d calls alike, by watching the ops that reach the dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter = Counter()

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                name = func.__name__.split(".")[0].lstrip("_")
                kind = next((k for k, names in KINDS.items() if name.startswith(names)), None)
                if kind is not None:
                    counts[kind] += 1
            return func(*args, **(kwargs or {}))

    with Watch():
        yield counts


def rank_main(args: argparse.Namespace) -> None:
    """One rank of one layout (the ``--rank`` internal mode): its numbers into ``--result``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    layout = next(x for x in LAYOUTS if x.name == args.layout)
    if layout.world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{args.store}",
            rank=args.rank,
            world_size=layout.world,
            timeout=timedelta(seconds=300),
        )
    result = measure(layout, QUICK if args.quick else FULL, **chunking(args))
    Path(args.result).write_text(json.dumps(result))
    if layout.world > 1:
        dist.barrier()  # nobody tears the group down while a peer still talks to it
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the table
def missing_options(layout: Layout) -> list[str]:
    """The options of ``layout`` that ``TrainConfig`` has no field for (not built yet)."""
    from rlblocks.trainer import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return [name for name in layout.options if name not in fields]


def chunking(args: argparse.Namespace) -> dict[str, int]:
    """``--logprob-chunk-size`` as a ``TrainConfig`` field, when given."""
    chunk = args.logprob_chunk_size
    return {} if chunk is None else {"logprob_chunk_size": chunk}


def run_layout(layout: Layout, args: argparse.Namespace) -> list[dict[str, int]]:
    """Every rank of ``layout`` in a fresh process; each rank's numbers, in rank order. A rank
    that fails stops the others (the processes started here) and raises with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["PYTHONPATH"] += os.pathsep + os.environ.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as folder:
        results = [Path(folder) / f"rank{r}.json" for r in range(layout.world)]
        argv = [sys.executable, __file__, "--layout", layout.name, "--store", f"{folder}/store"]
        argv += ["--quick"] if args.quick else []
        chunk = args.logprob_chunk_size
        argv += [] if chunk is None else ["--logprob-chunk-size", str(chunk)]
        procs = [
            subprocess.Popen(
                [*argv, "--rank", str(r), "--result", str(results[r])],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(layout.world)
        ]
        _wait(procs, layout, args.timeout)
        return [json.loads(path.read_text()) for path in results]


def _wait(procs: list[subprocess.Popen], layout: Layout, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        failed = [r for r, p in enumerate(procs) if p.poll() != 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if failed:
        rank = failed[0]
        output = procs[rank].stdout.read()[-3000:] if procs[rank].stdout else ""
        raise RuntimeError(
            f"mesh_memory: {layout.name}: rank {rank} of {layout.world} failed (exit status "
            f"{procs[rank].returncode}, limit {timeout:.0f} s); fix what its output below "
            f"names, or raise --timeout if it ran out of time:\n{output}"
        )


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(rows: dict[str, dict[str, int] | str]) -> str:
    """The markdown table: per layout, the largest value over its ranks, and its ratio to the
    one-process row for the weight-side total (params + grads + optimizer), saved, rss."""
    one = rows["one process"]
    assert isinstance(one, dict)
    head = (
        "| layout | ranks | tokens/rank | params MiB | grads MiB | optimizer MiB | "
        "weight-side MiB (×) | held whole KiB | saved activations MiB (×) | RSS growth MiB (×) | "
        "collectives per pass |"
    )
    lines = [head, "|---" * 11 + "|"]
    weight_one = one["params"] + one["grads"] + one["optimizer"]
    for name, row in rows.items():
        layout = next(x for x in LAYOUTS if x.name == name)
        if isinstance(row, str):
            lines.append(f"| {name} | {layout.world} | {row} |" + " |" * 8)  # 11 cells
            continue
        weight = row["params"] + row["grads"] + row["optimizer"]
        cells = [
            name,
            str(layout.world),
            str(row["tokens"]),
            mib(row["params"]),
            mib(row["grads"]),
            mib(row["optimizer"]),
            f"{mib(weight)} ({weight / weight_one:.3f})",
            f"{row['whole'] / 2**10:.1f}",
            f"{mib(row['saved'])} ({row['saved'] / one['saved']:.3f})",
            f"{mib(row['rss'])} ({row['rss'] / max(one['rss'], 1):.3f})",
            ", ".join(f"{k.split('/')[1]} {n}" for k, n in row.items() if "/" in k) or "none",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def setup_line(args: argparse.Namespace, shape: Shape, one: Any) -> str:
    """What was measured: the model, its size, the batch, the chunking, the processes."""
    from rlblocks.trainer import TrainConfig

    model = "the tiny test model" if args.quick else "a random-init Qwen2"
    parameters = one[0]["params"] // 4  # float32, one process: every parameter once
    chunk = args.logprob_chunk_size or TrainConfig().logprob_chunk_size
    return (
        f"{model} {shape.model} ({parameters:,} parameters), float32, tied embeddings; "
        f"{shape.rows} rows x ({shape.prompt} + {shape.response}) tokens, packed, one "
        f"micro-batch per rank, logprob_chunk_size {chunk}; gloo, one thread per rank, seed 0. "
        "Each cell: the largest over the layout's ranks."
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny model, 2 rows of 64 tokens")
    p.add_argument(
        "--layouts",
        nargs="+",
        default=[x.name for x in LAYOUTS],
        choices=[x.name for x in LAYOUTS],
        help="which rows to measure ('one process' is always measured: the ratios' base)",
    )
    p.add_argument(
        "--logprob-chunk-size",
        type=int,
        help="TrainConfig.logprob_chunk_size (tokens per chunk of the output layer's log-probs; "
        "default: the trainer's)",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per layout")
    p.add_argument("--out", type=Path, help="write results.json (every rank's numbers) here")
    p.add_argument("--layout", help=argparse.SUPPRESS)  # (internal) one rank of this layout
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict[str, int]] | str]:
    """Measure every layout asked for; print the setup and the table; return each layout's
    per-rank numbers (or why it did not run)."""
    args = parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return {}
    shape = QUICK if args.quick else FULL
    names = ["one process", *(n for n in args.layouts if n != "one process")]
    measured: dict[str, list[dict[str, int]] | str] = {}
    for layout in (x for x in LAYOUTS if x.name in names):
        missing = missing_options(layout)
        if missing:
            measured[layout.name] = f"not built yet (TrainConfig has no {', '.join(missing)})"
            continue
        start = time.perf_counter()
        measured[layout.name] = run_layout(layout, args)
        print(f"{layout.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(setup_line(args, shape, measured["one process"]))
    rows = {
        name: v if isinstance(v, str) else {c: max(r.get(c, 0) for r in v) for c in v[0]}
        for name, v in measured.items()
    }
    print(table(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"shape": dataclasses.asdict(shape), "layouts": measured}
        (args.out / "results.json").write_text(json.dumps(record, indent=1))
    return measured


if __name__ == "__main__":
    main()
