"""The main job's plumbing, run on the tiny model: outputs are written and complete."""

import json

import pytest
import torch

import rlblocks as rb
from rlblocks import demo
from rlblocks.runlog import read_metrics


def test_demo_smoke_run_writes_its_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--steps", "2", "--eval-size", "4", "--group-size", "2"]
    summary = demo.main(
        [*argv, "--prompts-per-step", "2", "--max-new-tokens", "4", "--out", str(out)]
    )
    assert set(summary) == {"before", "after", "steps", "train_minutes"}
    assert 0.0 <= summary["before"] <= 1.0 and 0.0 <= summary["after"] <= 1.0
    assert json.loads((out / "summary.json").read_text()) == summary
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for key in ("reward/mean", "response_length", "clip_frac", "grad_norm", "time/update"):
        assert key in records[0], key
    assert "kl/token" not in records[0]  # --kl-coef 0: no reference model, nothing scored
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_resumes_and_never_mixes_two_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--eval-size", "4", "--group-size", "2", "--out", str(out)]
    argv += ["--prompts-per-step", "2", "--max-new-tokens", "4"]
    with pytest.raises(SystemExit, match="holds no complete checkpoint"):
        demo.main([*argv, "--steps", "2", "--resume"])
    first = demo.main([*argv, "--steps", "2"])
    with pytest.raises(SystemExit, match="holds a run already: pass --resume"):
        demo.main([*argv, "--steps", "2"])
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]  # untouched
    summary = demo.main([*argv, "--steps", "3", "--resume"])  # one more step
    assert summary["before"] == first["before"] and summary["steps"] == 3
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["sync/version"] for r in records] == [1, 2, 3]  # the resharder's version goes on
    assert rb.checkpoint.Checkpointer(out / "checkpoints").steps() == [3]  # the newest only


def test_demo_with_a_kl_coefficient_keeps_a_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    argv = ["--model", "tiny", "--steps", "1", "--eval-size", "2", "--group-size", "2"]
    argv += ["--prompts-per-step", "2", "--max-new-tokens", "4", "--kl-coef", "0.1"]
    demo.main([*argv, "--out", str(tmp_path / "run")])
    (record,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert record["kl/token"] == 0.0  # π_old is the initial policy at step 0: k3 = 0 exactly
    assert "kl_loss" in record or "kl" in record


def test_demo_runs_one_step_off(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    argv = ["--model", "tiny", "--steps", "3", "--eval-size", "2", "--group-size", "2"]
    argv += ["--prompts-per-step", "2", "--max-new-tokens", "4", "--async"]
    threads = torch.get_num_threads()
    try:
        demo.main([*argv, "--out", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(threads)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["async/staleness"] for r in records] == [0.0, 1.0, 1.0]
    assert all(r["sync/bytes"] > 0 for r in records)  # the engine's own copy is synced
    with pytest.raises(SystemExit, match="--async runs with the in-process HF engine"):
        demo.main([*argv, "--workers", "2", "--out", str(tmp_path / "other")])


def test_demo_rejects_unknown_task():
    import pytest

    with pytest.raises(SystemExit):
        demo.parse_args(["--task", "chess"])


@pytest.mark.ray
def test_demo_runs_on_two_ray_workers(tmp_path):
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--steps", "2", "--eval-size", "4", "--group-size", "2"]
    summary = demo.main(
        [
            *argv,
            "--prompts-per-step",
            "2",
            "--max-new-tokens",
            "4",
            "--workers",
            "2",
            "--out",
            str(out),
        ]
    )
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert [r["sync/version"] for r in records] == [1, 2]
    assert all(r["sync/bytes"] > 0 for r in records)  # two engine copies filled every step
    assert 0.0 <= summary["after"] <= 1.0


def test_demo_device_defaults_to_cuda_only_where_there_is_one():
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert demo.parse_args([]).device == expected
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
            demo.main(["--model", "tiny", "--device", "cuda", "--steps", "1"])


@pytest.mark.gpu
def test_demo_trains_on_the_gpu(tmp_path, monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("RLBLOCKS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--model", "tiny", "--device", "cuda", "--steps", "2", "--eval-size", "4"]
    summary = demo.main([*argv, "--group-size", "2", "--max-new-tokens", "4", "--out", str(out)])
    assert summary["steps"] == 2
    records = read_metrics(out / "metrics.jsonl")
    assert all(r["optimizer_steps"] == 1.0 for r in records)  # the GPU step really updated
