#!/usr/bin/env bash
# The GPU check of docs/gpu.md, in one go, in at most 8 minutes on one H100: install from .whl/
# what the machine's image lacks (TRL, datasets, ...: scripts/gpu_wheels.py), run the GPU tests
# (pytest -m gpu), then on a random-init Qwen2.5-0.5B-shaped model in bf16 with EOS-terminated
# responses: benchmarks/rollout.py (every engine's tokens/s at 256 and 64 rows),
# benchmarks/update.py (the policy update alone: eager, compiled and TRL's, at 4k/16k/64k
# tokens) and benchmarks/grpo_step.py (the floor, rlblocks with its fastest engine, rlblocks
# with HF generate, TRL, and the continuous-batching engine). Everything lands in one folder.
#
#   bash scripts/gpu-check.sh [--dry-run] [--out DIR]
#
# --dry-run: check that the wheels are there and complete, print every command, run none of
#            them (works on a machine without a GPU).
# --out DIR: where the logs and results go (default runs/gpu-check).
# Environment: GPU_WHEELS (the wheel folder, default .whl), PYTHON (default .venv/bin/python
# where it exists, else python3: the GPU machine's), GPU_SITE
# (where the wheels are installed, default /tmp/gpu-check-site).
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
out=runs/gpu-check
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) dry=1 ;;
        --out) out=${2:?gpu-check: --out needs a folder; pass --out DIR}; shift ;;
        -h | --help) sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu-check: unknown argument '$1'; pass --dry-run and/or --out DIR" >&2; exit 2 ;;
    esac
    shift
done
wheels=${GPU_WHEELS:-.whl}
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
site=${GPU_SITE:-/tmp/gpu-check-site}

# Each timed step has a deadline: tests 90 s, rollout 120 s, update 80 s, GRPO step 150 s;
# with the install, the checks and the models written, the whole check stays under 8 minutes.
TESTS_S=90
ROLLOUT_S=120
UPDATE_S=80
BENCH_S=150
ROLLOUT=(benchmarks/rollout.py --model qwen2-0.5b-random --dtype bfloat16 --device cuda
    --responses eos --n 4 --max-new-tokens 256 --repeats 2 --threads 4
    --engines hf compiled cb)
UPDATE=(benchmarks/update.py --model qwen2-0.5b-random --dtype bfloat16 --device cuda
    --tokens 4096,16384,65536 --warmup 1 --steps 3 --threads 4)
BENCH=(benchmarks/grpo_step.py --model qwen2-0.5b-random --dtype bf16 --device cuda
    --responses eos --prompts 64 --group-size 4 --max-new-tokens 256 --micro-batch 32
    --steps 3 --repeats 1 --threads 4 --keep-going
    --systems floor rlblocks rlblocks-hf trl rlblocks-cb)

show() { printf '+'; printf ' %q' "$@"; printf '\n'; }

# run CMD...: print it; run it unless --dry-run.
run() {
    show "$@"
    [ "$dry" = 1 ] || "$@"
}

# logged LOG CMD...: print it; unless --dry-run, run it with its output also into LOG.
logged() {
    local log=$1
    shift
    show "$@"
    echo "  (output also into $log)"
    [ "$dry" = 1 ] && return 0
    "$@" 2>&1 | tee "$log"
    return "${PIPESTATUS[0]}"
}

echo "gpu-check: wheels from $wheels, results into $out$([ "$dry" = 1 ] && echo ', dry run')"
if ! "$py" scripts/gpu_wheels.py check --wheels "$wheels"; then
    echo "gpu-check: the wheels in $wheels are not complete (above); run scripts/fetch-gpu-wheels.sh" >&2
    exit 1
fi

run mkdir -p "$out" || exit 1
run "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl || exit 1
export PYTHONPATH="$site:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export RLBLOCKS_CACHE=${RLBLOCKS_CACHE:-/tmp/gpu-check-cache}
# On the machine: the wheels' requirements against what is really installed (a mismatch is
# reported and the check goes on: whatever it breaks shows below, with its own error).
logged "$out/environment.txt" "$py" scripts/gpu_wheels.py check --wheels "$wheels" --installed
logged "$out/nvidia-smi.txt" nvidia-smi

# The GPU tests: every test file that marks one gpu; a file that also needs Ray is left out
# where Ray is not installed (the GPU machines' image has none).
tests=()
for file in $(grep -rlE --include='test_*.py' 'mark\.gpu' tests | sort); do
    if grep -q 'mark\.ray' "$file" && ! "$py" -c 'import ray' 2>/dev/null; then
        echo "gpu-check: leaving out $file: it needs Ray, which this Python lacks"
        continue
    fi
    tests+=("$file")
done
logged "$out/pytest.txt" timeout "$TESTS_S" "$py" -m pytest -m gpu -q -p no:cacheprovider -rs \
    "${tests[@]}"
tests_rc=$?

# Generation alone, every engine side by side: 256 rows (64 prompts x 4), then 64 (16 x 4).
logged "$out/rollout.txt" timeout "$ROLLOUT_S" bash -c 'py=$1 dir=$2; shift 2
    "$py" "$@" --prompts 64 --out "$dir/rollout-256" && "$py" "$@" --prompts 16 --out "$dir/rollout-64"' \
    rollout "$py" "$out" "${ROLLOUT[@]}"
rollout_rc=$?

# The update alone on rows already made: eager, compiled blocks and TRL's, 4k to 64k tokens.
logged "$out/update.txt" timeout "$UPDATE_S" "$py" "${UPDATE[@]}" --out "$out/update"
update_rc=$?

logged "$out/benchmark.txt" timeout "$BENCH_S" "$py" "${BENCH[@]}" --out "$out"
bench_rc=$?

if [ "$dry" = 1 ]; then
    echo "gpu-check: dry run: the wheels are complete; nothing above was run"
    exit 0
fi
echo "gpu-check: GPU tests exit $tests_rc, rollout exit $rollout_rc, update exit $update_rc," \
    "GRPO step exit $bench_rc (124: past its deadline); results in $out"
[ "$tests_rc" = 0 ] && [ "$rollout_rc" = 0 ] && [ "$update_rc" = 0 ] && [ "$bench_rc" = 0 ]
