"""Shared by the resume tests (tests/checkpoint/test_resume*.py): the jobs' environment, their
results, and what "the same run" means."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np
import torch

from rlblocks.tracking.runlog import read_metrics

ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def result(out: Path) -> dict:
    """What the run returned and saved, and what its tracker logged (when it had one)."""
    saved = torch.load(out / "result.pt", weights_only=False)
    for key, name in (("logged", "metrics.jsonl"), ("samples", "samples.jsonl")):
        if (out / name).is_file():
            saved[key] = read_metrics(out / name)
    return saved


def untimed(history: list[dict]) -> list[dict]:
    """The metrics without the wall-clock ones (``time/*``, ``*seconds*``, throughput)."""
    timing = re.compile(r"^time/|seconds|per_second")
    return [{k: v for k, v in h.items() if not timing.search(k)} for h in history]


def assert_same_records(xs: list[dict], ys: list[dict]) -> None:
    """Equal lists of metric dicts, NaN equal to NaN."""
    assert len(xs) == len(ys)
    for step, (x, y) in enumerate(zip(xs, ys, strict=True)):
        assert x.keys() == y.keys(), step
        for key in x:
            same = x[key] == y[key] or (math.isnan(x[key]) and math.isnan(y[key]))
            assert same, (step, key, x[key], y[key])


def assert_identical(a: dict, b: dict, *, steps: int) -> None:
    """The same ``steps`` metrics (timings aside) and the same final weights, bit for bit; with
    a tracker, ``a`` logged each step once (none twice after its resume, none lost) and the
    same sampled completions as ``b``."""
    assert len(a["history"]) == len(b["history"]) == steps
    assert_same_records(untimed(a["history"]), untimed(b["history"]))
    if "logged" in a:
        logged = [{"step": i, **h} for i, h in enumerate(a["history"])]
        assert_same_records(untimed(a["logged"]), untimed(logged))
        assert a["samples"] == b["samples"]
    for part in ("policy", "critic"):
        if part in a:
            for name, tensor in a[part].items():
                assert torch.equal(tensor, b[part][name]), (part, name)


def assert_same_state(a, b, where: str = "state") -> None:
    """Equal state of the same types all the way down: tensors by dtype, shape and bits,
    NumPy arrays by dtype and bytes, NaN equal to NaN."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        bits = [x.contiguous().reshape(-1).view(torch.uint8) for x in (a, b)]
        assert torch.equal(*bits), where
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, (where, a, b)


def gap_over_travel(got: dict, want: dict, start: dict) -> float:
    """‖got − want‖ / ‖want − start‖ over the tensors ``start`` holds: how far two runs from
    the same ``start`` ended apart, relative to how far they went."""
    names = sorted(start)
    gap = torch.cat([(got[n] - want[n]).flatten() for n in names]).norm()
    travel = torch.cat([(want[n] - start[n]).flatten() for n in names]).norm()
    assert travel > 0
    return (gap / travel).item()


def assert_travelled_alike(got: dict, want: dict, start: dict, *, rel: float) -> None:
    """``got`` and ``want`` ended within ``rel`` of the distance travelled from ``start``."""
    ratio = gap_over_travel(got, want, start)
    assert ratio <= rel, f"the runs ended {ratio:.2e} of their travel apart (allowed: {rel})"
