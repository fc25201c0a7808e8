#!/usr/bin/env bash
# The memory planner against one GPU, in one go (docs/memory.md, "On a GPU"): install from
# .whl/ what the machine's image lacks (scripts/gpu_wheels.py; datasets for rlblocks.data), then
# benchmarks/memory_plan.py --device cuda: a random-init Qwen2.5-0.5B-shaped model in bf16,
# five configurations, predicted against torch.cuda.max_memory_allocated, bound ±10%.
#
#   bash scripts/gpu-memory-plan.sh [--dry-run] [--out DIR]
#
# --dry-run: check the wheels, print the configurations and their plans, install and measure
#            nothing (any machine).
# Results: --out DIR, else runs/memory-plan-gpu: memory_plan.txt,
# results.json, results.md. About 3 minutes on an H100; the benchmark's deadline is 420 s.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
site=${GPU_SITE:-/tmp/gpu-memory-plan-site}
out=runs/memory-plan-gpu
dry=()
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) dry=(--dry-run) ;;
        --out) out=${2:?gpu-memory-plan: --out needs a folder; pass --out DIR}; shift ;;
        *) echo "gpu-memory-plan: unknown argument '$1'; pass --dry-run and/or --out DIR" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"
"$py" scripts/gpu_wheels.py check --wheels .whl || {
    echo "gpu-memory-plan: the wheels in .whl are not complete; run scripts/fetch-gpu-wheels.sh" >&2
    exit 1
}
if [ ${#dry[@]} = 0 ]; then  # a dry run uses this machine's packages (wheels for 3.12)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || exit 1
fi
PYTHONPATH="$site:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 timeout 420 \
    "$py" benchmarks/memory_plan.py --device cuda "${dry[@]}" --out "$out" 2>&1 |
    tee "$out/memory_plan.txt"
exit "${PIPESTATUS[0]}"
