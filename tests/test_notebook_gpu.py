"""On a GPU kernel a tutorial trains on the GPU without an edit: no notebook names a device,
and every block that loads a model picks CUDA when torch sees one (rlblocks.models.device).

The notebook's code cells run as one script (what a kernel runs, cell after cell) in smoke mode
(the tiny model), in a fresh process outside the checkout. The GPU machine of docs/gpu.md has
no Jupyter kernel, so no kernel is started; the .ipynb is read as the JSON it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Every tutorial but 05, which needs Ray (the GPU machine's image has none).
NOTEBOOKS = [p for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if "ray" not in p.stem]

# Put before the first cell: every PolicyTrainer.step records where its weights are (a
# notebook may build several trainers and rebind one name); printed after the last cell.
PRELUDE = """
import rlblocks as _rb
_where = []
_step = _rb.trainer.PolicyTrainer.step
def _recorded(self, *args, **kwargs):
    _where.append(next(self.model.parameters()).device.type)
    return _step(self, *args, **kwargs)
_rb.trainer.PolicyTrainer.step = _recorded
"""
CHECK = """
print("DEVICES", ",".join(sorted(set(_where))))
print("STEPS", len(_where))
"""


def code_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def test_no_tutorial_names_a_device():
    # The promise holds for every tutorial only if none pins one (device="cpu" in a cell would
    # train on the CPU of a GPU kernel).
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        code = "\n".join(code_cells(path))
        assert "device=" not in code and ".to(" not in code, path.name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_a_tutorial_trains_on_the_gpu_without_an_edit(notebook, tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text("\n\n".join([PRELUDE, *code_cells(notebook), CHECK]))
    env = {**os.environ, "RLBLOCKS_SMOKE": "1", "RLBLOCKS_CACHE": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = dict(line.split(" ", 1) for line in done.stdout.splitlines()[-2:])
    assert found["DEVICES"] == "cuda"  # every training step of every trainer
    assert int(found["STEPS"]) >= 1  # 02 (PPO) trains its policy once in smoke mode: a
    # critic warm-up step, then one step
