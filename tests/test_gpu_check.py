"""scripts/gpu-check.sh --dry-run and scripts/gpu_wheels.py: the GPU check's wheels and commands.

The check itself needs the GPU machine (docs/gpu.md); its dry run must work anywhere: it checks
that the wheel folder holds everything the machine's image lacks and prints the commands it
would run, running none. The wheels here are real wheel files (a zip with a dist-info METADATA)
written into ``tmp_path``, with the requirements of the real ones, so no registry is needed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What the pinned wheels require (their Requires-Dist, shortened to what the check walks).
REQUIRES = {
    ("trl", "1.16.0"): ["accelerate>=1.10.1", "datasets>=4.7.0", "transformers>=4.56.2"],
    ("datasets", "5.2.0"): [
        "dill<0.4.2,>=0.3.0",
        "multiprocess<0.70.20",
        "pyarrow>=24.0.0",
        "fsspec<=2026.9.0,>=2023.1.0",
        "pytest; extra == 'tests'",
    ],
    ("dill", "0.4.1"): [],
    ("multiprocess", "0.70.19"): ["dill>=0.4.1"],
    ("gguf", "0.19.0"): ["numpy>=1.17", "pyyaml>=5.1", "requests>=2.25"],
    ("jsonargparse", "4.53.0"): ["PyYAML>=3.13"],
}


def write_wheel(
    folder: Path, name: str, version: str, requires: list[str], tag: str = "py3-none-any"
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-{tag}.whl"
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(metadata) + "\n")
    return path


def full_set(folder: Path) -> Path:
    for (name, version), requires in REQUIRES.items():
        write_wheel(folder, name, version, requires)
    return folder


def dry_run(tmp_path: Path, wheels: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env |= {"GPU_WHEELS": str(wheels), "PYTHON": sys.executable, "GPU_SITE": str(tmp_path / "site")}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--out", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def load_wheels_module():
    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_names_the_missing_wheels_and_runs_nothing(tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    result = dry_run(tmp_path, empty)
    assert result.returncode == 1
    for name in ("datasets", "gguf", "jsonargparse"):
        assert f"gpu_wheels: missing {name} (required by rlblocks: {name}>=" in result.stdout
    assert "gpu_wheels: missing trl (required by rlblocks[bench]: trl>=1.10)" in result.stdout
    assert "run scripts/fetch-gpu-wheels.sh" in result.stderr
    assert "\n+ " not in result.stdout and not (tmp_path / "out").exists()


def test_the_dry_run_names_a_requirement_that_only_a_wheel_has(tmp_path):
    # datasets asks for a package that is neither in the image nor among the wheels
    wheels = full_set(tmp_path / "wheels")
    (wheels / "datasets-5.2.0-py3-none-any.whl").unlink()
    write_wheel(wheels, "datasets", "5.2.0", [*REQUIRES["datasets", "5.2.0"], "xyzzy-io>=1"])
    result = dry_run(tmp_path, wheels)
    assert result.returncode == 1
    assert "gpu_wheels: missing xyzzy-io (required by datasets 5.2.0: xyzzy-io>=1)" in result.stdout
    assert "1 problem(s)" in result.stdout  # the extra-only requirement (pytest) is not asked for


def test_the_dry_run_prints_every_command_and_runs_none(tmp_path):
    result = dry_run(tmp_path, full_set(tmp_path / "wheels"))
    assert result.returncode == 0, result.stdout + result.stderr
    commands = [line for line in result.stdout.splitlines() if line.startswith("+ ")]
    assert [c.split()[1:3] for c in commands] == [
        ["mkdir", "-p"],
        [sys.executable, "-m"],  # pip install
        [sys.executable, "scripts/gpu_wheels.py"],  # the check against what is installed
        ["nvidia-smi"],
        ["timeout", "90"],  # pytest -m gpu
        ["timeout", "120"],  # the rollout benchmark, 256 then 64 rows
        ["timeout", "80"],  # the update alone
        ["timeout", "150"],  # the GRPO step
    ]
    install, tests, rollout, update, bench = commands[1], *commands[4:8]
    assert "--no-index --no-deps" in install and f"--target {tmp_path / 'site'}" in install
    assert all(f"{tmp_path / 'wheels'}/{n}-{v}-py3-none-any.whl" in install for n, v in REQUIRES)
    assert "-m pytest -m gpu" in tests and "tests/trainer/test_gpu.py" in tests
    assert "--model qwen2-0.5b-random --dtype bf16 --device cuda --responses eos" in bench
    assert "--systems floor rlblocks rlblocks-hf trl rlblocks-cb" in bench
    assert (
        "benchmarks/rollout.py --model qwen2-0.5b-random --dtype bfloat16 --device cuda" in rollout
    )
    assert "--engines hf compiled cb" in rollout and "rollout-256" in rollout
    assert (
        "benchmarks/update.py --model qwen2-0.5b-random --dtype bfloat16 --device cuda "
        "--tokens 4096,16384,65536" in update.replace("\\,", ",")  # printf %q escapes commas
    )
    assert update.endswith(f"--out {tmp_path / 'out' / 'update'}")
    assert "--keep-going" in bench  # one system failing leaves the others measured
    assert bench.endswith(f"--out {tmp_path / 'out'}")
    assert "nothing above was run" in result.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "site").exists()


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (("trl", "1.15.0", []), "two versions of trl: trl-1.15.0-py3-none-any.whl and"),
        (("numpy", "2.0.0", [], "cp311-cp311-manylinux_2_17_x86_64"),
         "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl does not install on CPython 3.12"),
        (("accelerate", "1.0.0", []),
         ("accelerate 1.0.0 on accelerate-1.0.0-py3-none-any.whl does not meet trl 1.16.0's "
          "accelerate>=1.10.1")),
    ],
)  # fmt: skip
def test_the_check_refuses_a_folder_pip_would_refuse(tmp_path, extra, problem):
    wheels_module = load_wheels_module()
    folder = full_set(tmp_path / "wheels")
    write_wheel(folder, *extra)
    _, found = wheels_module.problems(folder)
    assert any(line.startswith(problem) for line in found), found


def test_the_check_refuses_wheels_past_the_carry_limit(tmp_path, monkeypatch, capsys):
    wheels_module = load_wheels_module()
    monkeypatch.setattr(wheels_module, "LIMIT", 1024)  # the real 64 MiB, scaled to a test
    assert wheels_module.check(full_set(tmp_path / "wheels"), installed=False) == 1
    assert (
        "MiB, over the 0.0 MiB that travel to the GPU machine; carry fewer wheels"
        in capsys.readouterr().out
    )
