#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels that scripts/gpu-check.sh installs on the GPU
# machine, which reaches no package registry: scripts/gpu_wheels.py's PINS, each without its
# dependencies, for the machine's CPython 3.12 on x86-64 Linux. Then check that they are
# complete (every requirement is a wheel here or in the machine's image) and print their total
# against the 64 MiB that travel to the GPU machine with the working tree.
#
#   bash scripts/fetch-gpu-wheels.sh   # GPU_WHEELS=DIR: another folder; PYTHON: default .venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${GPU_WHEELS:-.whl}
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p "$dest"
mapfile -t pins < <("$py" scripts/gpu_wheels.py pins)
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dest" "${pins[@]}"
"$py" scripts/gpu_wheels.py check --wheels "$dest"
